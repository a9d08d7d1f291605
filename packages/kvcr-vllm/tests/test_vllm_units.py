"""kvcr-vllm pieces without an engine: config validation, stats, registration (copy runs are
kvcr-core's: test_copy_engine.py)."""

from __future__ import annotations

import subprocess

import pytest

from kvcr_core.attach import Mode
from kvcr_core.errors import ConfigError
from kvcr_vllm.settings import ConnectorSettings


@pytest.mark.unit
@pytest.mark.parametrize("extra,field", [
    ({"mode": "guraded"}, "kv_connector_extra_config.mode"),
    ({"mode": "guarded"}, "kv_connector_extra_config.socket"),
    ({"socket": 7}, "kv_connector_extra_config.socket"),
    ({"pool_bytes": "lots"}, "kv_connector_extra_config.pool_bytes"),
    ({"pool_size": "1GiB"}, "kv_connector_extra_config.pool_size"),
    ({"load": "yes"}, "kv_connector_extra_config.load"),
    ({"timeout_s": 0}, "kv_connector_extra_config.timeout_s"),
    ({"kvcr": {"eviction_polcy": "lru"}}, "eviction_polcy"),
    ({"peer_nixl": "on"}, "kv_connector_extra_config.peer_nixl"),
    ({"fetch_wait_s": 5}, "kv_connector_extra_config.fetch_wait_s"),
    ({"fetch_wait_s": "50ms"}, "kv_connector_extra_config.fetch_wait_s"),
    ({"prefault": "yes"}, "kv_connector_extra_config.prefault"),
    ({"mode": "guarded", "socket": "/run/kvcr/g.sock", "prefault": True},
     "kv_connector_extra_config.prefault"),
    ({"back_ahead": "lots"}, "kv_connector_extra_config.back_ahead"),
    ({"back_ahead": "256MiB", "prefault": True}, "kv_connector_extra_config.back_ahead"),
    ({"mode": "guarded", "socket": "/run/kvcr/g.sock", "back_ahead": "1GiB"},
     "--back-ahead"),
])
def test_bad_extra_config_names_the_field(extra: dict, field: str) -> None:
    """A wrong kv_connector_extra_config is a start-up error naming the field and the fix."""
    with pytest.raises(ConfigError) as err:
        ConnectorSettings.from_extra_config(extra, "engine-1")
    assert field in str(err.value)


@pytest.mark.unit
def test_extra_config_defaults_and_values() -> None:
    """Embedded by default on a private short socket; guarded takes the given socket."""
    default = ConnectorSettings.from_extra_config({}, "0123456789abcdef-engine")
    assert default.mode is Mode.EMBEDDED and default.socket.startswith("\0kvcr-embedded-")
    assert len(default.socket.encode()) < 100
    guarded = ConnectorSettings.from_extra_config(
        {"mode": "guarded", "socket": "/run/kvcr/g.sock", "pool_bytes": "2GiB",
         "kvcr": {"eviction_policy": "arc"}, "save": False}, "e")
    assert guarded.socket == "/run/kvcr/g.sock" and guarded.runner.pool_bytes == 2 << 30
    assert guarded.runner.eviction_policy == "arc" and not guarded.save and guarded.load
    assert not default.peer.nixl  # NIXL (pool writable by peers) only when asked for
    assert default.fetch_wait_s == 0.05 and not default.prefault
    tuned = ConnectorSettings.from_extra_config({"fetch_wait_s": 0, "prefault": True}, "e")
    assert tuned.fetch_wait_s == 0 and tuned.prefault and not tuned.back_ahead_bytes
    ahead = ConnectorSettings.from_extra_config({"back_ahead": "256MiB"}, "e")
    assert ahead.back_ahead_bytes == 256 << 20 and not ahead.prefault


@pytest.mark.unit
def test_stats_aggregate_reduce_and_bounded_labels() -> None:
    """Stats from workers and the scheduler add up; the load-time sample list stays bounded."""
    pytest.importorskip("vllm", reason="stats subclass vLLM's KVConnectorStats")
    from kvcr_vllm.stats import KVCRConnectorStats, StatsRecorder

    a, b = StatsRecorder(), StatsRecorder()
    a.add("loaded_blocks", 3)
    a.failure("guard_unavailable")
    b.add("loaded_blocks", 2)
    b.hint_outcome("bad_hashes")
    for _ in range(600):
        b.load_seconds(0.001)
    sa, sb = a.take(), b.take()
    assert sa is not None and sb is not None and a.take() is None
    total = sa.aggregate(sb)
    reduced = total.reduce()
    assert reduced["loaded_blocks"] == 5 and reduced["failures_guard_unavailable"] == 1
    assert reduced["hints_bad_hashes"] == 1 and len(total.data["load_seconds"]) <= 512
    assert KVCRConnectorStats().is_empty()
    with pytest.raises(AssertionError):
        a.failure("made_up_reason")


@pytest.mark.unit
def test_plugin_registers_the_connector_name_once() -> None:
    """The vllm.general_plugins entry point makes "KVCRConnector" resolvable by name."""
    pytest.importorskip("vllm", reason="registration needs vLLM's factory")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from kvcr_vllm import plugin

    plugin.register()  # idempotent
    by_name = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="KVCRConnector", kv_role="kv_both"))
    by_path = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="KVCRConnector", kv_role="kv_both",
                         kv_connector_module_path="kvcr_vllm.connector"))
    assert by_name is by_path and by_name.__name__ == "KVCRConnector"


@pytest.mark.unit
def test_unsupported_vllm_version_refuses_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the supported vLLM versions the connector refuses with a clear message."""
    vllm = pytest.importorskip("vllm", reason="needs vLLM")
    from kvcr_vllm import connector

    monkeypatch.setattr(vllm, "__version__", "0.99.1")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x; this is vLLM 0\.99\.1"):
        connector.check_vllm_version()


@pytest.mark.unit
def test_shipped_examples_are_valid_connector_configs() -> None:
    """The example kv-transfer-configs in examples/vllm parse with the connector's rules."""
    import json
    from pathlib import Path

    folder = Path(__file__).resolve().parents[3] / "examples" / "vllm"
    for path in sorted(folder.glob("*.json")):
        config = json.loads(path.read_text())
        assert config["kv_connector"] == "KVCRConnector"
        settings = ConnectorSettings.from_extra_config(config["kv_connector_extra_config"], "e")
        assert settings.mode in (Mode.EMBEDDED, Mode.GUARDED)


def _in_fresh_vllm(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, **env})


@pytest.mark.integration
def test_an_unsupported_vllm_gets_the_clear_error_not_an_unknown_connector() -> None:
    """Risk: under another vLLM version the plugin registered nothing, so vLLM failed with
    "unknown connector" and no hint why; and raising in the plugin would break every vLLM
    start on a machine where kvcr-vllm is merely installed."""
    pytest.importorskip("vllm", reason="registration needs vLLM's factory")
    out = _in_fresh_vllm(
        "import vllm; vllm.__version__ = '0.99.1'\n"
        "from kvcr_vllm import plugin; plugin.register()\n"
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "cls = KVConnectorFactory.get_connector_class(\n"
        "    KVTransferConfig(kv_connector='KVCRConnector', kv_role='kv_both'))\n"
        "print('registered', cls.__module__)\n"
        "cls(None, None, None)\n")
    assert "registered kvcr_vllm.unsupported" in out.stdout, out.stderr[-2000:]
    assert out.returncode != 0
    assert "supports vLLM 0.32.x; this is vLLM 0.99.1" in out.stderr


@pytest.mark.integration
@pytest.mark.parametrize("level, shown", [("INFO", True), ("WARNING", False)])
def test_kvcr_log_lines_go_through_vllms_handler_at_its_level(level: str, shown: bool) -> None:
    """Risk: kvcr's INFO lines vanish in a vLLM server and its warnings print without time
    or level (its loggers are not under vLLM's), so operators cannot follow what it does."""
    pytest.importorskip("vllm", reason="vLLM's logging configuration")
    out = _in_fresh_vllm(
        "import logging, vllm\n"
        "from kvcr_vllm import plugin; plugin.register()  # as vLLM loads plugins, then:\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig())  # what vLLM's launchers and engine core do\n"
        "logging.getLogger('kvcr_vllm.scheduler').info('kvcr-info-line')\n"
        "logging.getLogger('kvcr_core.attach').warning('kvcr-warning-line')\n",
        VLLM_LOGGING_LEVEL=level)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = (out.stdout + out.stderr).splitlines()
    warning = [line for line in lines if "kvcr-warning-line" in line]
    assert len(warning) == 1 and "WARNING" in warning[0]
    assert any(ch.isdigit() for ch in warning[0].split("WARNING")[1][:12])  # vLLM's time
    assert any("kvcr-info-line" in line and "INFO" in line for line in lines) is shown
