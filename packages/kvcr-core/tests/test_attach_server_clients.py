"""The attach server with real client processes (through kvcr-guard, its production host):
sharing, crashes, restarts, isolation."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from kvcr_core.attach import AttachClient
from kvcr_core.keys import NamespaceSpec, sequence_keys
from kvcr_core.testing import pattern_block

pytestmark = pytest.mark.integration

BLOCK = 16384
SPEC = NamespaceSpec(model_id="tiny", dtype="float32", kv_dtype="float32", block_size_tokens=16,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/guard")


def keys_for(prompt: int, blocks: int) -> list[bytes]:
    """The same keys attach_worker.py derives."""
    return sequence_keys(SPEC, [prompt * 100_000 + t for t in range(16 * blocks)])


def read_line(proc: subprocess.Popen[str]) -> dict[str, int]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "worker died"
    return json.loads(line)  # type: ignore[no-any-return]


def kill_and_settle(proc: subprocess.Popen[str], observer: AttachClient, field: str):
    """SIGKILLs a client, then waits (10 s at most) until the daemon reclaimed `field`."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while getattr(observer.stats(), field) and time.monotonic() < deadline:
        time.sleep(0.02)
    return observer.stats()


def test_two_processes_read_each_others_blocks_byte_exactly(guard, harness) -> None:
    """Blocks stored by one engine process are read byte-exactly by another."""
    assert harness.run_worker(guard, "store", 1, 8) == {"stored": 8}
    assert harness.run_worker(guard, "store", 2, 5) == {"stored": 5}
    assert harness.run_worker(guard, "read", 1, 8) == {"read": 8, "lookup": 8}
    assert harness.run_worker(guard, "read", 2, 6) == {"read": 5, "lookup": 5}
    assert guard.metric("kvcr_blocks_stored_total") == 13


def test_client_killed_mid_write_never_publishes_and_others_go_on(guard, harness) -> None:
    """SIGKILL during a write: the block never becomes READY, its slots come back."""
    writer = harness.start_worker(guard, "hang-writing", 3, 6)
    assert read_line(writer) == {"reserved": 6}
    observer = AttachClient(guard.socket, SPEC, BLOCK)
    assert observer.stats().filling_blocks == 6
    stats = kill_and_settle(writer, observer, "filling_blocks")
    assert stats.filling_blocks == 0 and stats.open_reservations == 0
    assert observer.lookup(keys_for(3, 6)) == 0
    assert stats.free_slots == stats.capacity_slots
    assert guard.metric("kvcr_guard_reclaimed_blocks_total") == 6
    assert harness.run_worker(guard, "store", 3, 6) == {"stored": 6}  # others unaffected
    assert harness.run_worker(guard, "read", 3, 6) == {"read": 6, "lookup": 6}
    observer.close()


def test_killed_readers_leases_are_reclaimed(guard, harness) -> None:
    """A client killed while holding leases gives them back (blocks become evictable)."""
    harness.run_worker(guard, "store", 4, 4)
    reader = harness.start_worker(guard, "hold-lease", 4, 4)
    assert read_line(reader) == {"leased": 4}
    observer = AttachClient(guard.socket, SPEC, BLOCK)
    assert observer.stats().leased_slots == 4
    stats = kill_and_settle(reader, observer, "leased_slots")
    assert stats.leased_slots == 0 and stats.open_leases == 0
    assert observer.lookup(keys_for(4, 4)) == 4  # READY blocks stay
    observer.close()


def test_killed_and_restarted_client_is_warm(guard, harness) -> None:
    """SIGKILL an engine after it stored blocks; the restarted engine finds them at once."""
    engine = harness.start_worker(guard, "store-hang", 5, 7)
    assert read_line(engine) == {"stored": 7}
    engine.send_signal(signal.SIGKILL)
    engine.wait(timeout=10)
    assert harness.run_worker(guard, "read", 5, 7) == {"read": 7, "lookup": 7}


def test_reattach_with_same_identity_is_warm(guard) -> None:
    """Detach and re-attach under the same identity: every READY block is there."""
    keys = keys_for(10, 4)
    first = AttachClient(guard.socket, SPEC, BLOCK, identity="engine-0")
    first.store(keys, [pattern_block(k, BLOCK) for k in keys])
    first.close()
    again = AttachClient(guard.socket, SPEC, BLOCK, identity="engine-0")
    assert again.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    again.close()


def test_namespaces_are_isolated(guard, harness) -> None:
    """Clients of another namespace never see blocks, even with identical keys."""
    harness.run_worker(guard, "store", 6, 3)
    other = AttachClient(guard.socket, NamespaceSpec(**{**SPEC.__dict__, "tenant": "b"}), BLOCK)
    assert other.lookup(keys_for(6, 3)) == 0
    same = AttachClient(guard.socket, SPEC, BLOCK)
    assert same.lookup(keys_for(6, 3)) == 3
    other.close()
    same.close()
