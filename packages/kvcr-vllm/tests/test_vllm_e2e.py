"""kvcr-vllm with the real vLLM CPU engine and a tiny local model, in separate processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")

from vllm.engine.arg_utils import EngineArgs

from kvcr_core.attach import AttachClient
from kvcr_core.keys import sequence_keys
from kvcr_core.testing import secret_for
from kvcr_vllm.settings import namespace_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = [(i * 7919) % 2000 + 4 for i in range(2100)]  # 65 full blocks of 32 + 20 tokens
FULL_BLOCK_TOKENS = (len(PROMPT) // 32) * 32


def next_json(proc) -> dict:
    """The engine's next JSON line (vLLM logs to stdout too)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"engine exited: {proc.stderr.read()[-3000:] if proc.stderr else ''}")


def guarded(socket: str) -> dict[str, str]:
    return {"mode": "guarded", "socket": socket}


def corrupt_pool(model: str, socket: str, tokens: list[int]) -> int:
    """Overwrites every stored block of `tokens` with noise, through the real pool mapping."""
    config = EngineArgs(model=model, dtype="float32", max_model_len=4096, block_size=32,
                        enforce_eager=True).create_engine_config()
    spec = namespace_for(config, 0)
    client = AttachClient(socket, spec, block_bytes_from_stats(socket, spec))
    keys = sequence_keys(spec, tokens)
    lease = client.acquire(keys, prefix_only=False)
    noise = bytes((i * 131 + 7) % 256 for i in range(client.pool().slot_bytes))
    for slot in lease.slots:
        if slot is not None:
            client.pool().write(slot, noise)
    client.release(lease.op)
    client.close()
    return lease.granted


def block_bytes_from_stats(socket: str, spec) -> int:
    kvcr = str(Path(sys.executable).parent / "kvcr")
    status = json.loads(subprocess.run([kvcr, "status", "--socket", socket, "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    (ns,) = [n for n in status["namespaces"] if n["namespace"] == spec.digest().hex()]
    return int(ns["block_bytes"])


def test_cross_engine_reuse_is_exact_and_really_used(guard, run_engine, tiny_model) -> None:
    """Engine B reuses A's KV through kvcr-guard: every full block hit, same greedy output as
    an engine without kvcr, and corrupting the pool changes the output (the KV is used)."""
    (plain,) = run_engine("none", [{"tokens": PROMPT}])
    (a,) = run_engine("plugin", [{"tokens": PROMPT}], guarded(guard.socket))
    assert a["metrics"]["vllm:external_prefix_cache_hits"] == 0
    assert a["metrics"]["vllm:kvcr_stored_blocks"] >= len(PROMPT) // 32
    (b,) = run_engine("module", [{"tokens": PROMPT}], guarded(guard.socket))
    assert b["metrics"]["vllm:external_prefix_cache_hits"] >= FULL_BLOCK_TOKENS - 32
    assert b["cached"] >= FULL_BLOCK_TOKENS - 32
    assert b["metrics"]["vllm:kvcr_loaded_blocks"] >= len(PROMPT) // 32 - 1
    assert b["tokens"] == a["tokens"] == plain["tokens"]
    assert corrupt_pool(tiny_model, guard.socket, PROMPT) >= len(PROMPT) // 32 - 1
    (c,) = run_engine("plugin", [{"tokens": PROMPT}], guarded(guard.socket))
    assert c["metrics"]["vllm:external_prefix_cache_hits"] >= FULL_BLOCK_TOKENS - 32
    assert c["tokens"] != plain["tokens"]
    # The same corrupted pool with verify_loads: blocks fail their check inside the step
    # that loads them (host caches load synchronously), vLLM drops that step's token and
    # recomputes, and the output is the recompute's (risk: a failed synchronous load served)
    verified = {**guarded(guard.socket), "kvcr": {"verify_loads": True}}
    (d,) = run_engine("plugin", [{"tokens": PROMPT}], verified)
    assert d["metrics"]["vllm:kvcr_failures{reason=load_checksum}"] >= len(PROMPT) // 32 - 1
    assert d["tokens"] == plain["tokens"]


def test_sigkilled_engine_restarts_warm(guard, run_engine, start_engine) -> None:
    """SIGKILL an engine after it served a prompt; the restarted engine hits that prompt."""
    first = start_engine("plugin", [{"tokens": PROMPT[:1100]}], guarded(guard.socket), hold=True)
    served = next_json(first)
    assert next_json(first) == {"holding": True}
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    (again,) = run_engine("plugin", [{"tokens": PROMPT[:1100]}], guarded(guard.socket))
    assert again["metrics"]["vllm:external_prefix_cache_hits"] >= (1100 // 32 - 1) * 32
    assert again["tokens"] == served["tokens"]
    # An engine attaches at start-up, before any request (risk: the first request paying
    # the attach, or a prefaulting daemon's namespace open)
    idle = start_engine("plugin", [], guarded(guard.socket), hold=True)
    try:
        assert next_json(idle) == {"holding": True}
        status = json.loads(subprocess.run(
            [str(Path(sys.executable).parent / "kvcr"), "status", "--socket", guard.socket,
             "--json"], capture_output=True, text=True, check=True).stdout)
        engine = [i for i in status["identities"] if i.startswith("vllm-")]
        assert any("scheduler" in i for i in engine) and any("worker" in i for i in engine)
    finally:
        idle.kill()
        idle.wait(timeout=30)


def pool_mappings_kib(pid: int) -> list[int]:
    """Rss (KiB) of each mapping of a kvcr pool memfd in process `pid`."""
    sizes, inside = [], False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and " " in line:  # a mapping's header line
            inside = "/memfd:kvcr-" in line
        elif inside and line.startswith("Rss:"):
            sizes.append(int(line.split()[1]))
    return sizes


def test_an_engine_maps_a_prefaulted_pool_before_its_first_request(
        short_tmp, harness, start_engine) -> None:
    """Risk: an engine attached to a --prefault kvcr-guard still pays a page fault for every
    pool page its loads and saves touch first (a 64 MiB load out of a freshly mapped pool
    took 7.5 ms against 4 ms, a save 25 ms against 4 ms), on its requests' path."""
    guard = harness.Guard(short_tmp, "--pool-bytes", "256MiB", "--namespace-pool-bytes",
                          "256MiB", "--prefault").start()
    idle = start_engine("plugin", [], guarded(guard.socket), hold=True)
    try:
        assert next_json(idle) == {"holding": True}
        deadline = time.monotonic() + 60
        while max(pool_mappings_kib(idle.pid), default=0) < 256 << 10:
            assert time.monotonic() < deadline, pool_mappings_kib(idle.pid)
            time.sleep(0.1)
        # the worker's mapping holds the whole pool; the scheduler's (lookups only) does not
        assert sorted(pool_mappings_kib(idle.pid))[0] < (256 << 10) // 8
    finally:
        idle.kill()
        idle.wait(timeout=30)
        assert guard.stop() == 0, guard.logs()
        guard.log.close()


def test_guard_down_recomputes_and_counts(short_tmp, run_engine) -> None:
    """No daemon behind the socket: requests succeed by recomputing; the fault is counted.
    Also: a malformed kv_hint is counted and the request served; a bad extra config is a
    clear start-up error."""
    missing = f"{short_tmp}/none.sock"
    bad_hint = {"kv_hint": {"protocol_version": "0.1", "actions": [{
        "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": "tcp://10.9.9.9:1",
                    "block_hashes": ["not-a-hash"]}}]}}
    results = run_engine("plugin", [{"tokens": PROMPT[:700]},
                                    {"tokens": PROMPT[:700], "params": bad_hint}],
                         guarded(missing), bad_extra={"mode": "guraded", "socket": missing})
    error, first, second = results
    assert "kv_connector_extra_config.mode" in error["bad_extra_error"]
    assert "guraded" in error["bad_extra_error"]
    assert first["tokens"] == second["tokens"]
    assert second["metrics"]["vllm:kvcr_failures{reason=guard_unavailable}"] >= 1
    assert second["metrics"]["vllm:kvcr_hints{outcome=bad_hashes}"] == 1


def test_embedded_mode_serves_the_engine_from_its_own_runner(run_engine) -> None:
    """Default (embedded) mode: after vLLM drops its own prefix cache, the prompt is loaded
    from the in-engine Runner, output unchanged; the private socket is gone after exit."""
    import glob

    before = set(glob.glob("/tmp/kvcr-*.sock"))
    first, second = run_engine("plugin", [{"tokens": PROMPT[:1500]},
                                          {"tokens": PROMPT[:1500], "reset_prefix_cache": True}])
    assert first["metrics"]["vllm:external_prefix_cache_hits"] == 0
    assert second["metrics"]["vllm:external_prefix_cache_hits"] >= (1500 // 32) * 32 - 32
    assert second["metrics"]["vllm:prefix_cache_hits"] == first["metrics"][
        "vllm:prefix_cache_hits"]
    assert second["tokens"] == first["tokens"]
    assert set(glob.glob("/tmp/kvcr-*.sock")) == before


def engine_namespace(model: str):
    config = EngineArgs(model=model, dtype="float32", max_model_len=4096, block_size=32,
                        enforce_eager=True).create_engine_config()
    return namespace_for(config, 0)


def test_hint_fetches_from_the_named_peer_and_recomputes_when_it_is_gone(
        run_engine, start_engine, tiny_model, monkeypatch) -> None:
    """Embedded engines: a request to B with a kv_hint naming A fetches A's blocks (external
    hits, same output); with A killed, B recomputes within the fetch deadline; a hint naming
    an endpoint that is not a configured peer is refused and counted."""
    from kvcr_core.keys import router_hashes

    monkeypatch.setenv("KVCR_PEER_SECRET", secret_for("e2e-peer-secret-0123456789abcdef"))
    prompt = PROMPT[:1300]
    a = start_engine("plugin", [{"tokens": prompt}], {"peer_listen": "127.0.0.1:0"}, hold=True)
    try:
        served = next_json(a)
        assert next_json(a) == {"holding": True}
        endpoint = served["params"]["kvcr_peer_endpoint"]
        hashes = router_hashes(sequence_keys(engine_namespace(tiny_model), prompt))
        hint = {"kv_hint": {"protocol_version": "0.1", "message_id": "m1", "actions": [{
            "action_type": "kv.fetch", "action_version": "1.0",
            "payload": {"source_control_endpoint": endpoint, "block_hashes": hashes}}]}}
        stranger = {"kv_hint": {"protocol_version": "0.1", "actions": [{
            "action_type": "kv.fetch", "action_version": "1.0",
            "payload": {"source_control_endpoint": "tcp://127.0.0.1:9", "block_hashes": hashes}}]}}
        (b, b_stranger) = run_engine(
            "plugin", [{"tokens": prompt, "params": hint},
                       {"tokens": prompt[:700] + [5] * 40, "params": stranger}],
            {"peers": [endpoint], "fetch_deadline_s": 5})
        assert b["metrics"]["vllm:external_prefix_cache_hits"] >= (1300 // 32) * 32 - 32, b
        assert b["metrics"]["vllm:kvcr_peer_fetched_blocks"] >= 1300 // 32 - 1
        assert b["tokens"] == served["tokens"]
        assert b_stranger["metrics"]["vllm:kvcr_failures{reason=peer_not_allowed}"] == 1
    finally:
        a.kill()
        a.wait(timeout=30)
    (c,) = run_engine("plugin", [{"tokens": prompt, "params": hint}],
                      {"peers": [endpoint], "fetch_deadline_s": 2})
    assert c["tokens"] == served["tokens"]
    assert c["metrics"]["vllm:external_prefix_cache_hits"] == 0
    assert c["metrics"]["vllm:kvcr_failures{reason=peer_fetch}"] >= 1
    assert c["seconds"] < 30


def test_an_embedded_engine_is_observable_like_the_daemon(start_engine) -> None:
    """Risk: in the default (embedded) mode the Runner's metrics are served nowhere and
    `kvcr status` cannot reach it, so an operator sees nothing of the pool a vLLM engine
    runs; and kvcr's log lines do not reach vLLM's log."""
    import socket
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = start_engine("plugin", [{"tokens": PROMPT[:1000]}],
                          {"metrics_listen": f"127.0.0.1:{port}"}, hold=True)
    try:
        assert engine.stdout is not None
        lines = []
        for line in engine.stdout:
            lines.append(line)
            if '"holding"' in line:
                break
        logged = [line for line in lines if "kvcr embedded runner serving" in line]
        assert logged and "INFO" in logged[0]  # through vLLM's handler: its level, its format
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                      timeout=10).read().decode()
        stored = [line for line in text.splitlines()
                  if line.startswith("kvcr_blocks_stored_total ")]
        assert stored and float(stored[0].split()[-1]) >= 1000 // 32 - 1
        assert 'kvcr_build_info{component="kvcr-embedded"' in text
        kvcr = str(Path(sys.executable).parent / "kvcr")
        out = subprocess.run([kvcr, "status", "--embedded", "vllm-worker", "--json"],
                             capture_output=True, text=True, timeout=30, check=False)
        assert out.returncode == 0, out.stderr
        (report,) = [r for r in json.loads(out.stdout)
                     if r["pid"] == engine.pid]  # (other tests' engines may run too)
        assert report["namespaces"][0]["ready_blocks"] >= 1000 // 32 - 1
    finally:
        engine.kill()
        engine.wait(timeout=30)
