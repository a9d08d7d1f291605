"""What an operator scrapes and asks: an embedded Runner's metrics on a port of its own,
process and build-info series, and `kvcr status` reaching embedded runners by their
abstract socket. Real runners, real HTTP, real sockets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvcr_core.attach import AttachClient, EmbeddedRunner, EngineSettings
from kvcr_core.cli.status_cmd import embedded_sockets
from kvcr_core.errors import ConfigError
from kvcr_core.keys import NamespaceSpec, block_keys
from kvcr_core.testing import pattern_block

pytestmark = pytest.mark.integration

BLOCK = 8192
SPEC = NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32", block_size_tokens=4,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/expo")
KVCR = str(Path(sys.executable).parent / "kvcr")


def embedded(name: str, **extra: object) -> EmbeddedRunner:
    fields = EngineSettings.fields_from({"pool_bytes": 64 * BLOCK, **extra}, field="cfg",
                                        default_socket=f"\0kvcr-embedded-{name}-{os.getpid()}")
    return EmbeddedRunner(EngineSettings(**fields))


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_an_embedded_runner_serves_its_metrics_on_its_own_port() -> None:
    """Risk: in embedded mode (the default) the Runner's kvcr_* and kvcr_peer_* series are
    served nowhere, so operators see nothing of the pool; or a taken port stops the engine."""
    runner = embedded("expo", metrics_listen="127.0.0.1:0")
    client = AttachClient(runner.socket_path, SPEC, BLOCK, identity="engine-one")
    keys = list(block_keys(SPEC.digest(), list(range(16)), 4))
    client.store(keys, [pattern_block(k, BLOCK) for k in keys])
    try:
        assert runner.metrics_port is not None
        text = scrape(runner.metrics_port)
        ns = SPEC.digest().hex()[:16]
        assert f'kvcr_pool_used_bytes{{namespace="{ns}"}} {float(4 * BLOCK)}' in text
        assert "kvcr_blocks_stored_total 4.0" in text
        assert 'kvcr_build_info{component="kvcr-embedded"' in text
        assert "process_resident_memory_bytes" in text and "kvcr_guard_clients 1.0" in text
        taken = embedded("expo2", metrics_listen=f"127.0.0.1:{runner.metrics_port}")
        assert taken.metrics_port is None  # logged, not fatal
        other = AttachClient(taken.socket_path, SPEC, BLOCK)
        assert other.store(keys, [pattern_block(k, BLOCK) for k in keys]) == 4
        other.close()
        taken.stop()
    finally:
        client.close()
        runner.stop()


def test_metrics_listen_is_checked_and_guarded_mode_points_at_the_daemon() -> None:
    """Risk: a typo'd metrics address is ignored (no metrics, no error), or guarded engines
    believe they export what only the daemon can."""
    for bad in ("9750", "host:port", ":99999"):
        with pytest.raises(ConfigError, match="metrics_listen"):
            EngineSettings.fields_from({"metrics_listen": bad}, field="cfg", default_socket="x")
    with pytest.raises(ConfigError, match="--metrics-port"):
        EngineSettings.fields_from({"mode": "guarded", "socket": "/g.sock",
                                    "metrics_listen": "0.0.0.0:9750"}, field="cfg",
                                   default_socket="x")


def _broken_runner_socket() -> tuple[str, object]:
    """A "@kvcr-..." listener that hangs up on every probe (a runner shutting down)."""
    import socket
    import threading

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"\0kvcr-embedded-broken-{os.getpid()}")
    listener.listen()

    def hang_up() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the test is over
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    return f"@kvcr-embedded-broken-{os.getpid()}", listener


def test_kvcr_status_finds_embedded_runners_by_socket_or_identity() -> None:
    """Risk: `kvcr status` reaches only kvcr-guard, so an operator cannot look into the
    default (embedded) deployment at all; or one runner it cannot read (hung, shutting
    down) hides every other one."""
    runner = embedded("statusme")
    broken, listener = _broken_runner_socket()
    client = AttachClient(runner.socket_path, SPEC, BLOCK, identity="vllm-worker-abc-tp0")
    client.lookup(list(block_keys(SPEC.digest(), list(range(4)), 4)))
    try:
        name = "@" + runner.socket_path[1:]
        assert name in embedded_sockets()
        for args in (["--socket", name], ["--embedded", "worker-abc"]):
            out = subprocess.run([KVCR, "status", *args, "--json"], capture_output=True,
                                 text=True, timeout=30, check=False)
            assert out.returncode == 0, out.stderr
            report = json.loads(out.stdout)
            report = report if isinstance(report, dict) else report[0]
            assert report["socket"] == name
            assert report["identities"] == ["vllm-worker-abc-tp0"]
            assert report["namespaces"][0]["namespace"] == SPEC.digest().hex()
        table = subprocess.run([KVCR, "status", "--embedded"], capture_output=True, text=True,
                               timeout=30, check=False)
        assert name in table.stdout and "vllm-worker-abc-tp0" in table.stdout
        assert table.returncode == 1 and f"cannot read {broken}" in table.stderr
        missing = subprocess.run([KVCR, "status", "--embedded", "no-such-engine"],
                                 capture_output=True, text=True, timeout=30, check=False)
        assert missing.returncode == 1 and "no embedded runner matches" in missing.stderr
    finally:
        listener.close()  # type: ignore[attr-defined]
        client.close()
        runner.stop()


def test_the_socket_table_lists_only_listening_kvcr_runners(tmp_path: Path) -> None:
    """Risk: status probes sockets that are not kvcr's, or connected (not listening) ones."""
    table = tmp_path / "unix"
    table.write_text(
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "0: 00000002 00000000 00010000 0001 01 1 @kvcr-embedded-a\n"
        "0: 00000003 00000000 00000000 0001 03 2 @kvcr-embedded-a\n"
        "0: 00000002 00000000 00010000 0001 01 3 @other\n"
        "0: 00000002 00000000 00010000 0001 01 4 /run/kvcr/guard.sock\n"
        "0: 00000002 00000000 00010000 0001 01 5 @kvcr-sglang-77\n")
    assert embedded_sockets(str(table)) == ["@kvcr-embedded-a", "@kvcr-sglang-77"]


def test_port_zero_picks_any_free_port() -> None:
    """Risk: port 0 (any free port: tests, several engines on one node) is refused."""
    fields = EngineSettings.fields_from({"metrics_listen": "127.0.0.1:0"}, field="cfg",
                                        default_socket="x")
    assert fields["metrics_listen"] == ("127.0.0.1", 0)


def test_kvcr_status_names_why_two_engines_of_one_model_never_share() -> None:
    """Risk: an operator mixes TP sizes (or block sizes, or engine builds) of one model, reuse
    is zero by design, and nothing says why."""
    import dataclasses

    runner = embedded("unshared", pool_bytes=256 * BLOCK,
                      kvcr={"namespace_pool_bytes": 32 * BLOCK})
    tp1 = dataclasses.replace(SPEC, model_id="org/model")
    tp2 = [dataclasses.replace(tp1, tp_size=2, tp_rank=r, num_kv_heads=1) for r in (0, 1)]
    other = dataclasses.replace(SPEC, model_id="org/other")
    clients = [AttachClient(runner.socket_path, [tp1, other], BLOCK, identity="engine-a"),
               AttachClient(runner.socket_path, tp2, BLOCK, identity="engine-b")]
    try:
        for client in clients:
            client.attach()
        name = "@" + runner.socket_path[1:]
        out = subprocess.run([KVCR, "status", "--socket", name, "--json"], capture_output=True,
                             text=True, timeout=30, check=False)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        (entry,) = report["unshared"]  # org/other has one namespace: nothing to say
        assert entry["model"] == "org/model"
        assert entry["differs"] == {"tp_size": [1, 2], "num_kv_heads": [1, 2]}
        assert sorted(entry["namespaces"]) == sorted(s.digest().hex() for s in [tp1, *tp2])
        models = {ns["namespace"]: (ns["model"], ns["tp_rank"]) for ns in report["namespaces"]}
        assert models[tp2[1].digest().hex()] == ("org/model", 1)
        table = subprocess.run([KVCR, "status", "--socket", name], capture_output=True,
                               text=True, timeout=30, check=False).stdout
        assert "NOTE model org/model: 3 namespaces never share blocks" in table
        assert "tp_size 1, 2" in table
    finally:
        for client in clients:
            client.close()
        runner.stop()
