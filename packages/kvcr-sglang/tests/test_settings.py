"""The extra-config edge and the import seam (no SGLang needed for these)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcr_core.attach import Mode
from kvcr_core.errors import ConfigError
from kvcr_core.testing import secret_for
from kvcr_sglang.pagestore import block_key, router_hash
from kvcr_sglang.settings import BackendSettings

BASE = {"backend_name": "kvcr", "module_path": "kvcr_sglang.hicache",
        "class_name": "KVCRHiCacheStorage", "interface_v1": 1, "prefetch_threshold": 256}


@pytest.mark.unit
def test_sglang_keys_are_accepted_and_kvcr_keys_parsed() -> None:
    """Risk: SGLang's own keys in the same mapping are refused, or kvcr's are ignored."""
    s = BackendSettings.from_extra_config({**BASE, "mode": "guarded", "socket": "/run/g.sock",
                                           "timeout_s": 1, "tenant": "t1"})
    assert (s.mode, s.socket, s.timeout_s, s.tenant) == (Mode.GUARDED, "/run/g.sock", 1.0, "t1")
    embedded = BackendSettings.from_extra_config(None)
    assert embedded.mode is Mode.EMBEDDED and embedded.socket.startswith("\0kvcr-sglang-")


@pytest.mark.unit
@pytest.mark.parametrize(("extra", "field"), [
    ({"sokcet": "/x"}, "sokcet"),
    ({"mode": "guarded"}, "socket"),
    ({"mode": "sidecar"}, "mode"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"tenant": 3}, "tenant"),
    ({"peers": ["http://x:1"]}, "peers"),
])
def test_bad_extra_config_names_the_field_and_the_fix(extra: dict[str, object],
                                                      field: str) -> None:
    """Risk: a typo or a wrong value silently disables the cache."""
    with pytest.raises(ConfigError) as err:
        BackendSettings.from_extra_config({**BASE, **extra})
    assert field in str(err.value)


@pytest.mark.unit
def test_keys_and_router_hashes_follow_sglang_page_hashes() -> None:
    """Risk: the block key or the router hash of a page differs from what SGLang's events and
    another kvcr node compute for the same page."""
    page = "4faa8bd53eda3d89" + "0" * 48
    assert block_key(page) == bytes.fromhex(page)[:16]
    assert router_hash(page) == 0x4FAA8BD53EDA3D89
    assert router_hash("not-a-page-hash") is None
    assert len(block_key("custom-key")) == 16 and block_key("a") != block_key("b")


@pytest.mark.integration
def test_importing_kvcr_sglang_pulls_in_neither_sglang_nor_torch() -> None:
    """Risk: the package drags SGLang/torch into processes that only read its settings."""
    code = ("import sys, kvcr_sglang, kvcr_sglang.settings, kvcr_sglang.pagestore; "
            "print(sorted(m for m in ('sglang', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.unit
def test_shipped_example_configs_are_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: the documented examples/sglang configs fail at SGLang start-up."""
    import json
    from pathlib import Path

    examples = Path(__file__).resolve().parents[3] / "examples" / "sglang"
    monkeypatch.setenv("KVCR_PEER_SECRET", secret_for("settings-test-secret-0123456789abcdef"))
    for name in ("hicache-guarded.json", "hicache-embedded.json"):
        BackendSettings.from_extra_config(json.loads((examples / name).read_text()))
    linker = json.loads((examples / "linker.json").read_text())
    assert linker["linker_module_path"] == "kvcr_sglang.linker"
    BackendSettings.from_extra_config(linker["linker_extra_config"])
