"""The checksum verifier thread: every verdict comes back, right or wrong, within the
reader's deadline; a full queue or a closed verifier never makes a reader wait (it checks
in the caller)."""

from __future__ import annotations

import threading
import time

import pytest

from kvcr_core.peers import verifier as verifier_module
from kvcr_core.peers.protocol import checksum
from kvcr_core.peers.verifier import Checks, Verifier

VIEWS = [memoryview(bytes([i]) * 4096) for i in range(4)]


def view(block: int) -> memoryview:
    return VIEWS[block]


def submitted(verifier: Verifier, blocks: list[int], expected: list[int]) -> Checks:
    checks = Checks(view, blocks, expected)
    verifier.submit(checks)
    return checks


def test_verdicts_follow_the_bytes_in_submission_order() -> None:
    """Risk: a wrong block passes, or verdicts land on the wrong blocks."""
    verifier = Verifier()
    expected = [checksum(v) for v in VIEWS]
    expected[2] ^= 1
    deadline = time.monotonic() + 5
    first = submitted(verifier, [0, 1], expected[:2])
    second = submitted(verifier, [2, 3], expected[2:])
    assert second.wait(deadline) == [False, True]
    assert first.wait(deadline) == [True, True]
    assert first.known() and second.known()
    verifier.close()


def test_a_hash_that_fails_refuses_the_chunk_and_the_thread_lives_on() -> None:
    """Risk: an exception in the thread leaves readers waiting forever or kills the thread."""
    verifier = Verifier()
    deadline = time.monotonic() + 5
    broken = submitted(verifier, [0], [1, 2])  # lengths disagree
    assert broken.wait(deadline) == [False, False]
    assert submitted(verifier, [1], [checksum(VIEWS[1])]).wait(deadline) == [True]
    verifier.close()


def test_waits_are_bounded_and_a_full_queue_is_checked_in_the_caller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a reader hangs on a busy verifier past its fetch deadline, or waits for room in
    its queue."""
    gate = threading.Event()
    real = checksum

    def stuck_on_block_0(data: memoryview) -> int:
        if data[0] == 0:
            gate.wait(10)
        return real(data)

    monkeypatch.setattr(verifier_module, "checksum", stuck_on_block_0)
    verifier = Verifier(max_pending=1)
    busy = submitted(verifier, [0], [real(VIEWS[0])])  # the thread hangs on this one
    time.sleep(0.05)
    queued = submitted(verifier, [0], [real(VIEWS[0])])  # this fills the queue
    beyond = submitted(verifier, [1], [real(VIEWS[1])])  # no room: checked right here
    assert beyond.known() and beyond.wait(time.monotonic()) == [True]
    with pytest.raises(TimeoutError):
        busy.wait(time.monotonic() + 0.05)
    assert not queued.known()
    gate.set()
    deadline = time.monotonic() + 5
    assert busy.wait(deadline) == [True] and queued.wait(deadline) == [True]
    verifier.close()


def test_after_close_checks_run_in_the_caller() -> None:
    """Risk: a fetch finishing during shutdown gets no verdicts (or hashes freed memory on a
    thread nobody joins)."""
    verifier = Verifier()
    deadline = time.monotonic() + 5
    assert submitted(verifier, [0], [checksum(VIEWS[0])]).wait(deadline) == [True]
    verifier.close()
    assert not any(t.name == "kvcr-verify" for t in threading.enumerate())
    late = submitted(verifier, [0], [checksum(VIEWS[0]) ^ 1])
    assert late.known() and late.wait(deadline) == [False]


def test_a_chunk_claimed_by_both_threads_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: the reader helping the verifier thread hashes a chunk the thread is already on
    (wasted work), or skips one neither has done (a verdict never comes)."""
    calls: list[int] = []
    gate = threading.Event()

    def slow_checksum(data: memoryview) -> int:
        calls.append(1)
        gate.wait(5)
        return checksum(data)

    monkeypatch.setattr(verifier_module, "checksum", slow_checksum)
    verifier = Verifier()
    deadline = time.monotonic() + 5
    busy = submitted(verifier, [0], [checksum(VIEWS[0])])  # the thread takes it
    while not calls:
        time.sleep(0.001)
    queued = submitted(verifier, [1], [checksum(VIEWS[1])])
    busy.run()  # already claimed by the thread: returns at once
    gate.set()
    queued.run()  # unclaimed: the caller hashes it here
    assert busy.wait(deadline) == [True] and queued.wait(deadline) == [True]
    verifier.close()
    assert len(calls) == 2


def test_a_chunk_nobody_submitted_is_checked_where_it_is_run() -> None:
    """Risk: the chunk a reader keeps for itself (the last of a fetch) is published without
    a verdict, or its verdict is waited for forever."""
    checks = Checks(view, [2, 3], [checksum(VIEWS[2]), checksum(VIEWS[3]) ^ 1])
    assert not checks.known()
    with pytest.raises(TimeoutError):
        checks.wait(time.monotonic() + 0.01)
    checks.run()
    assert checks.known() and checks.wait(time.monotonic()) == [True, False]
