"""The checksum verifier thread: every verdict comes back, right or wrong, within the
reader's deadline, and a closed verifier still checks (in the caller)."""

from __future__ import annotations

import threading
import time

import pytest

from kvcr_core.peers import verifier as verifier_module
from kvcr_core.peers.protocol import checksum
from kvcr_core.peers.verifier import Verifier


def blocks(n: int, size: int = 4096) -> list[memoryview]:
    return [memoryview(bytes([i]) * size) for i in range(n)]


def test_verdicts_follow_the_bytes_in_submission_order() -> None:
    """Risk: a wrong block passes, or verdicts land on the wrong blocks."""
    verifier = Verifier()
    views = blocks(4)
    expected = [checksum(v) for v in views]
    expected[2] ^= 1
    deadline = time.monotonic() + 5
    first = verifier.submit(views[:2], expected[:2], deadline)
    second = verifier.submit(views[2:], expected[2:], deadline)
    assert second.wait(deadline) == [False, True]
    assert first.wait(deadline) == [True, True]
    verifier.close()


def test_a_hash_that_fails_refuses_the_chunk_and_the_thread_lives_on() -> None:
    """Risk: an exception in the thread leaves readers waiting forever or kills the thread."""
    verifier = Verifier()
    deadline = time.monotonic() + 5
    broken = verifier.submit([memoryview(b"x")], [1, 2], deadline)  # lengths disagree
    assert broken.wait(deadline) == [False, False]
    view = blocks(1)[0]
    assert verifier.submit([view], [checksum(view)], deadline).wait(deadline) == [True]
    verifier.close()


def test_waits_are_bounded_by_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a reader hangs on a busy verifier past its fetch deadline."""
    gate = threading.Event()
    monkeypatch.setattr(verifier_module, "checksum", lambda view: gate.wait(10) and 0)
    verifier = Verifier(max_pending=1)
    soon = time.monotonic() + 0.2
    busy = verifier.submit(blocks(1), [0], soon)  # the thread hangs on this one
    time.sleep(0.05)
    queued = verifier.submit(blocks(1), [0], soon)  # this fills the queue
    with pytest.raises(TimeoutError):
        verifier.submit(blocks(1), [0], time.monotonic() + 0.05)
    with pytest.raises(TimeoutError):
        busy.wait(time.monotonic() + 0.05)
    gate.set()
    assert busy.wait(time.monotonic() + 5) == [True] and queued.wait(time.monotonic() + 5)
    verifier.close()


def test_after_close_checks_run_in_the_caller() -> None:
    """Risk: a fetch finishing during shutdown gets no verdicts (or hashes freed memory on a
    thread nobody joins)."""
    verifier = Verifier()
    view = blocks(1)[0]
    deadline = time.monotonic() + 5
    assert verifier.submit([view], [checksum(view)], deadline).wait(deadline) == [True]
    verifier.close()
    assert not any(t.name == "kvcr-verify" for t in threading.enumerate())
    assert verifier.submit([view], [checksum(view) ^ 1], deadline).wait(deadline) == [False]


def test_a_chunk_claimed_by_both_threads_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: the reader helping the verifier thread hashes a chunk the thread is already on
    (wasted work), or skips one neither has done (a verdict never comes)."""
    calls: list[int] = []
    gate = threading.Event()

    def slow_checksum(view: memoryview) -> int:
        calls.append(1)
        gate.wait(5)
        return checksum(view)

    monkeypatch.setattr(verifier_module, "checksum", slow_checksum)
    verifier = Verifier()
    deadline = time.monotonic() + 5
    views = blocks(2)
    busy = verifier.submit(views[:1], [checksum(views[0])], deadline)  # the thread takes it
    while not calls:
        time.sleep(0.001)
    queued = verifier.submit(views[1:], [checksum(views[1])], deadline)
    busy.run()  # already claimed by the thread: returns at once
    gate.set()
    queued.run()  # unclaimed: the caller hashes it here
    assert busy.wait(deadline) == [True] and queued.wait(deadline) == [True]
    verifier.close()
    assert len(calls) == 2
