"""The `kvcr` command as an operator runs it (the installed console script, a real process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcr_core import __version__
from kvcr_core.keys import NamespaceSpec, router_hashes, sequence_keys

pytestmark = pytest.mark.integration

KVCR = str(Path(sys.executable).parent / "kvcr")
REPO = Path(__file__).resolve().parents[3]
NS = {"model_id": "m", "dtype": "float32", "kv_dtype": "float32", "block_size_tokens": 4,
      "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "layout": "test/v1"}


def kvcr(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCR_")}
    return subprocess.run([KVCR, *args], capture_output=True, text=True, input=stdin,
                          env=env, timeout=120, check=False)


def test_version() -> None:
    """`kvcr --version` prints the package version."""
    out = kvcr("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"kvcr {__version__}"


def test_config_check_accepts_the_example_and_prints_resolved_values() -> None:
    """The shipped example config validates and the resolved values are printed as JSON."""
    out = kvcr("config", "check", str(REPO / "examples" / "kvcr.yaml"), "--no-env")
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout.split("\n", 1)[1])
    assert resolved["eviction_policy"] in ("lru", "arc")
    assert resolved["pool_bytes"] > 0


@pytest.mark.parametrize("body,field", [
    ("pool_bytes: 8 GB/s\n", "pool_bytes"),
    ("eviction_polcy: lru\n", "eviction_polcy"),
    ("eviction_policy: no_such_mod:Policy\n", "eviction_policy"),
])
def test_config_check_names_the_bad_field(tmp_path: Path, body: str, field: str) -> None:
    """A bad config exits 1 with a message naming the field."""
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    out = kvcr("config", "check", str(path), "--no-env")
    assert out.returncode == 1
    assert field in out.stderr


def test_keys_matches_the_library(tmp_path: Path) -> None:
    """`kvcr keys` prints the same keys and router hashes a router must compute."""
    tokens = list(range(100, 111))
    path = tmp_path / "tokens.txt"
    path.write_text(" ".join(map(str, tokens)))
    out = kvcr("keys", "--namespace", json.dumps(NS), str(path), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    keys = sequence_keys(NamespaceSpec.from_mapping(NS), tokens)
    assert [b["key"] for b in data["blocks"]] == [k.hex() for k in keys]
    assert [b["router_hash"] for b in data["blocks"]] == router_hashes(keys)
    table = kvcr("keys", "--namespace", json.dumps(NS), "-", stdin=json.dumps(tokens))
    assert keys[1].hex() in table.stdout


def test_keys_reports_bad_input() -> None:
    """Bad tokens or namespaces are usage errors with a reason, not tracebacks."""
    out = kvcr("keys", "--namespace", "{}", "-", stdin="1 2 3")
    assert out.returncode == 2 and "namespace" in out.stderr and "Traceback" not in out.stderr
    out = kvcr("keys", "--namespace", json.dumps(NS), "-", stdin="1 x 3")
    assert out.returncode == 2 and "integers" in out.stderr


def test_bench_without_kvcr_bench_installed_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Risk: `kvcr bench` on an engine host (where the tooling is not installed) fails with a
    traceback instead of saying what to install."""
    from kvcr_core.cli import main as cli

    monkeypatch.setattr(cli, "_bench_plugins", lambda: [])
    assert cli.main(["bench", "pool", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "from this repository" in err and "pip install './packages/kvcr-bench[guard]'" in err


def test_import_kvcr_core_pulls_no_engine_or_heavy_dependency(tmp_path: Path) -> None:
    """`import kvcr_core` (and the CLI) loads no torch, vllm, sglang or nixl."""
    heavy = ("torch", "vllm", "sglang", "nixl", "zmq")
    for name in heavy:  # importable stand-ins, so an import would succeed and be seen
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    code = ("import sys, kvcr_core, kvcr_core.cli.main, kvcr_core.runner, kvcr_core.hints, "
            "kvcr_core.attach, kvcr_core.peers, kvcr_core.testing\n"
            f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, env=env)
    assert out.stdout.strip() == ""
    check = "import sys, torch; print('torch' in sys.modules)"
    probe = subprocess.run([sys.executable, "-c", check],
                           capture_output=True, text=True, check=True, timeout=60, env=env)
    assert probe.stdout.strip() == "True"  # the stand-ins are visible: the check can fail
