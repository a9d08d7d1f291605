"""The kvcr-guard daemon: fail-open when it dies, SIGTERM, its socket, metrics and status,
its flags for backing the pool, its log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvcr_core.attach import AttachClient, RunnerUnavailable
from kvcr_core.keys import NamespaceSpec, sequence_keys
from kvcr_core.testing import mapped_kib, pattern_block, resident_kib

pytestmark = pytest.mark.integration

BLOCK = 16384
SPEC = NamespaceSpec(model_id="tiny", dtype="float32", kv_dtype="float32", block_size_tokens=16,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/guard")


def keys_for(prompt: int, blocks: int) -> list[bytes]:
    """The same keys attach_worker.py derives."""
    return sequence_keys(SPEC, [prompt * 100_000 + t for t in range(16 * blocks)])


def test_daemon_death_fails_open_then_reattaches_cold(short_tmp, harness) -> None:
    """Daemon killed: typed error, no hang; after it returns the client re-attaches (cold)."""
    guard = harness.Guard(short_tmp).start()
    client = AttachClient(guard.socket, SPEC, BLOCK, timeout_s=1.0)
    keys = keys_for(7, 2)
    assert client.store(keys, [pattern_block(k, BLOCK) for k in keys]) == 2
    guard.stop(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RunnerUnavailable):
        client.lookup(keys)
    with pytest.raises(RunnerUnavailable, match=r"backoff|attach_failed"):
        client.lookup(keys)
    assert time.monotonic() - start < 2.0
    guard.start()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert client.lookup(keys) == 0  # a new daemon: cold
            break
        except RunnerUnavailable:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert client.attach_count == 2
    client.close()
    assert guard.stop() == 0


def test_sigterm_drains_and_exits_zero_and_leaves_nothing(short_tmp, harness) -> None:
    """SIGTERM: clients get Goodbye, exit 0, socket file removed, no /dev/shm residue."""
    shm_before = set(os.listdir("/dev/shm"))
    guard = harness.Guard(short_tmp).start()
    client = AttachClient(guard.socket, SPEC, BLOCK)
    keys = keys_for(8, 2)
    client.store(keys, [pattern_block(k, BLOCK) for k in keys])
    assert guard.stop(signal.SIGTERM) == 0
    with pytest.raises(RunnerUnavailable):
        client.lookup(keys)
    client.close()
    guard.log.close()
    assert not os.path.exists(guard.socket)
    assert set(os.listdir("/dev/shm")) == shm_before
    assert "shutting down" in guard.logs()


def test_a_stop_as_soon_as_the_socket_exists_still_drains(short_tmp, harness) -> None:
    """Risk: SIGTERM between the socket's bind and the serving loop (a supervisor stopping a
    daemon that just started; a client that saw the socket and is done) killed the daemon
    with the default action (exit -15, nothing drained): the handlers were installed only
    when serving began. Deterministic half: they are in place once the socket is bound."""
    from kvcr_core.attach import ServerConfig
    from kvcr_guard.config import GuardConfig
    from kvcr_guard.daemon import GuardDaemon

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    daemon = GuardDaemon(GuardConfig(server=ServerConfig(
        socket_path=f"\0kvcr-signal-test-{os.getpid()}")))
    try:
        daemon.listen()
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, before[0])
        os.kill(os.getpid(), signal.SIGTERM)  # before run(): handled, so run() ends at once
        assert daemon.run() == 0
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
    for _ in range(3):  # and as processes: started, then stopped at once, exit 0
        guard = harness.Guard(short_tmp).start()
        assert guard.stop(signal.SIGTERM) == 0, guard.logs()
        guard.log.close()


def test_metrics_answer_as_soon_as_the_socket_exists(short_tmp, harness) -> None:
    """Risk: the metrics port was bound after the socket, so whoever waited for the socket
    (a supervisor, a readiness probe, a test) and scraped at once was refused (a CI failure:
    ECONNREFUSED on a fresh daemon's /metrics). Deterministic: at the moment the socket is
    bound, /metrics answers. And a metrics port someone else holds fails the start with an
    error that names the port and the fix, before any socket exists."""
    import urllib.request

    from kvcr_core.attach import ServerConfig
    from kvcr_guard.config import GuardConfig
    from kvcr_guard.daemon import GuardDaemon

    daemon = GuardDaemon(GuardConfig(server=ServerConfig(
        socket_path=os.path.join(short_tmp, "m.sock")), metrics_port=0))
    bind_socket, answers = daemon.server.listen, []

    def listen_after_a_scrape() -> None:
        port = daemon.metrics_port
        answers.append(port is not None and b"kvcr_build_info" in urllib.request.urlopen(
            f"http://127.0.0.1:{port}/metrics", timeout=10).read())
        bind_socket()

    daemon.server.listen = listen_after_a_scrape  # type: ignore[method-assign]
    daemon.listen()
    daemon.stop()
    assert daemon.run() == 0
    assert answers == [True]

    first = harness.Guard(short_tmp).start()
    os.mkdir(second := os.path.join(short_tmp, "b"))
    taken = subprocess.run([sys.executable, "-m", "kvcr_guard", "--socket",
                            os.path.join(second, "g.sock"), "--metrics-port",
                            str(first.metrics_port)], capture_output=True, text=True,
                           timeout=30, check=False)
    assert taken.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{first.metrics_port}" in taken.stderr
    assert "--metrics-port" in taken.stderr
    assert not os.path.exists(os.path.join(second, "g.sock"))


def test_refuses_a_second_daemon_on_a_live_socket(guard) -> None:
    """Starting a second daemon on a served socket fails clearly instead of stealing it."""
    out = subprocess.run([sys.executable, "-m", "kvcr_guard", "--socket", guard.socket],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 1 and "another kvcr runner is serving" in out.stderr


def test_socket_mode_and_status_command(guard, harness) -> None:
    """The socket is 0600; `kvcr status` shows the pool state an operator needs."""
    assert os.stat(guard.socket).st_mode & 0o777 == 0o600
    harness.run_worker(guard, "store", 9, 3)
    kvcr = os.path.join(os.path.dirname(sys.executable), "kvcr")
    out = subprocess.run([kvcr, "status", "--socket", guard.socket, "--json"],
                         capture_output=True, text=True, timeout=30, check=True)
    status = json.loads(out.stdout)
    assert status["namespaces"][0]["ready_blocks"] == 3
    assert status["namespaces"][0]["block_bytes"] == BLOCK
    table = subprocess.run([kvcr, "status", "--socket", guard.socket], capture_output=True,
                           text=True, timeout=30, check=True).stdout
    assert "ready" in table and SPEC.digest().hex()[:16] in table


SERVICE_ENV = {  # what the kubelet injects into every pod for Services named kvcr, kvcr-guard
    "KVCR_SERVICE_HOST": "10.0.0.4", "KVCR_SERVICE_PORT": "9750",  # and kvcr-router
    "KVCR_PORT": "tcp://10.0.0.4:9750", "KVCR_PORT_9750_TCP_ADDR": "10.0.0.4",
    "KVCR_GUARD_SERVICE_HOST": "10.0.0.5", "KVCR_GUARD_PORT": "tcp://10.0.0.5:9750",
    "KVCR_GUARD_PORT_9750_TCP_PROTO": "tcp", "KVCR_ROUTER_SERVICE_PORT_HTTP": "8000",
    "KVCR_ROUTER_PORT_8000_TCP": "tcp://10.0.0.6:8000"}


def test_a_pod_with_kvcr_services_in_its_namespace_starts(short_tmp, harness,
                                                          monkeypatch) -> None:
    """Risk: kvcr-guard and the kvcr CLI exit at start in an ordinary Kubernetes namespace,
    because the variables the kubelet injects for Services named kvcr* look like kvcr
    settings (a typo of a real one is still named, as a warning)."""
    for name, value in {**SERVICE_ENV, "KVCR_POOL_BYTEZ": "1GiB"}.items():
        monkeypatch.setenv(name, value)
    guard = harness.Guard(short_tmp).start()
    client = AttachClient(guard.socket, SPEC, BLOCK, identity="pod")
    keys = keys_for(3, 2)
    assert client.store(keys, [pattern_block(k, BLOCK) for k in keys]) == 2
    client.close()
    kvcr = os.path.join(os.path.dirname(sys.executable), "kvcr")
    status = subprocess.run([kvcr, "status", "--socket", guard.socket, "--json"],
                            capture_output=True, text=True, timeout=30, check=False)
    assert status.returncode == 0, status.stderr
    assert guard.stop() == 0
    assert "did you mean 'KVCR_POOL_BYTES'" in guard.logs()
    guard.log.close()


def _rss_shmem_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status").read().splitlines():  # noqa: SIM115
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    raise KeyError("RssShmem")


@pytest.mark.parametrize("prefault", [False, True])
def test_prefault_backs_a_namespace_in_the_daemon_before_any_client_writes(
        short_tmp, harness, prefault: bool) -> None:
    """Risk: with --prefault the engines still fault in the pool pages (so a Kubernetes memory
    cgroup charges them, not the guard container that requests the pool's memory), or the
    first namespace's pages are backed while its engine attaches (the engine's start waits,
    the daemon serves no one else) instead of before the socket exists; without it the daemon
    would back pages nobody asked for."""
    guard = harness.Guard(short_tmp, *(["--prefault"] if prefault else [])).start()
    assert guard.proc is not None
    at_start = _rss_shmem_kib(guard.proc.pid)  # (start() returns once the socket exists)
    client = AttachClient(guard.socket, SPEC, BLOCK, identity="prefault")
    client.attach()
    on_attach = _rss_shmem_kib(guard.proc.pid) - at_start
    region_kib = client.pool().region.size_bytes // 1024
    client.close()
    if prefault:
        assert at_start >= region_kib  # every page of the 8 MiB namespace, in the daemon
        assert on_attach < region_kib // 8  # the attach got that memory, not a second pool
    else:
        assert at_start + on_attach < region_kib // 8


@pytest.mark.parametrize("prefault", [False, True])
def test_an_engine_maps_a_backed_pool_ahead_of_its_first_copies(
        short_tmp, harness, prefault: bool) -> None:
    """Risk: every page of a --prefault pool still costs the engine a page fault the first
    time it copies into or out of it (a 64 MiB load 1.9x, a save 6x slower, measured), on
    the request's path; or an engine maps in a pool the guard did not back, and so backs it
    itself (charged to the engine's memory cgroup, not the guard's)."""
    guard = harness.Guard(short_tmp, *(["--prefault"] if prefault else [])).start()
    assert guard.proc is not None
    engine = AttachClient(guard.socket, SPEC, BLOCK, identity="engine", map_pages=True)
    control = AttachClient(guard.socket, SPEC, BLOCK, identity="lookups only")
    try:
        engine.attach()
        control.attach()
        region = engine.pool().region
        if prefault:
            deadline = time.monotonic() + 30
            while (mapped_kib(region.address) < region.size_bytes // 1024
                   and time.monotonic() < deadline):
                time.sleep(0.02)
            assert mapped_kib(region.address) >= region.size_bytes // 1024
        else:
            time.sleep(0.5)
            assert mapped_kib(region.address) < region.size_bytes // 1024 // 8
            assert _rss_shmem_kib(guard.proc.pid) < region.size_bytes // 1024 // 8
        assert mapped_kib(control.pool().region.address) < region.size_bytes // 1024 // 8
    finally:
        engine.close()
        control.close()


def test_back_ahead_backs_the_pool_in_the_daemon_as_it_fills(short_tmp, harness) -> None:
    """Risk (--back-ahead): the daemon backs the whole pool anyway (a VM's other processes'
    first touches slow while it holds it), or hands an engine slots whose pages it has not
    backed (the engine's memory cgroup pays for them, not the guard container that requests
    the pool's memory), or the engine's page mapper backs pages itself or never maps those
    backed after it attached."""
    guard = harness.Guard(short_tmp, "--back-ahead", "1MiB").start()
    assert guard.proc is not None
    at_start = _rss_shmem_kib(guard.proc.pid)
    engine = AttachClient(guard.socket, SPEC, BLOCK, identity="engine", map_pages=True)
    try:
        engine.attach()
        region = engine.pool().region
        assert 1024 <= at_start < region.size_bytes // 1024 // 4  # the margin, backed first
        reservation = engine.reserve(keys_for(9, 160))  # 2.5 MiB of 16 KiB blocks
        top = max(s for s in reservation.slots if s is not None) + 1
        assert _rss_shmem_kib(guard.proc.pid) >= top * BLOCK // 1024  # before the reply
        for slot in reservation.slots:
            assert slot is not None
            engine.pool().write(slot, pattern_block(bytes([slot % 256]) * 4, BLOCK))
        deadline = time.monotonic() + 30
        while (mapped_kib(region.address) < top * BLOCK // 1024 + 1024
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert mapped_kib(region.address) >= top * BLOCK // 1024 + 1024  # used + margin
        held = _rss_shmem_kib(guard.proc.pid)
        assert held < region.size_bytes // 1024 // 2  # not the whole pool
        assert resident_kib(region.address, region.size_bytes) == held  # all the guard's
    finally:
        engine.close()


def test_back_ahead_with_prefault_or_a_bad_size_is_refused(short_tmp) -> None:
    """Risk: a manifest that asks for both backings, or a size that is no size, starts a
    daemon that silently does one thing; the error names the flag and the fix."""
    sock = os.path.join(short_tmp, "g.sock")
    for flags, fix in ((["--prefault", "--back-ahead", "1GiB"], "give one of the two"),
                       (["--back-ahead", "lots"], "--back-ahead='lots': give a size")):
        out = subprocess.run([sys.executable, "-m", "kvcr_guard", "--socket", sock, *flags],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2 and fix in out.stderr, out.stderr
        assert not os.path.exists(sock)


def test_status_probes_leave_the_log_alone(guard) -> None:
    """Risk: a readiness probe running `kvcr status` every 10 s writes a log line each time
    and buries what matters; an engine's departure must still be logged."""
    kvcr = os.path.join(os.path.dirname(sys.executable), "kvcr")
    for _ in range(5):
        subprocess.run([kvcr, "status", "--socket", guard.socket, "--json"],
                       capture_output=True, text=True, timeout=30, check=True)
    client = AttachClient(guard.socket, SPEC, BLOCK, identity="engine-x")
    client.lookup(keys_for(1, 1))
    client.close()
    deadline = time.monotonic() + 10
    while "engine-x" not in guard.logs() and time.monotonic() < deadline:
        time.sleep(0.05)
    logs = guard.logs()
    assert "status served" not in logs
    assert sum("engine-x" in line and "closed" in line for line in logs.splitlines()) == 1


def test_the_daemon_says_what_it_is_and_what_it_costs(guard) -> None:
    """Risk: operators cannot alert on the daemon's memory against its limit or see which
    version runs where (no process_* or build-info series)."""
    from kvcr_guard._version import __version__

    assert guard.metric("kvcr_build_info", component="kvcr-guard", version=__version__) == 1
    assert guard.metric("process_resident_memory_bytes") > 0
    assert guard.metric("process_open_fds") > 0
