"""The read lanes of NIXL fetches: every chunk is done once, by whichever lane claims it; a
chunk that fails stops the job and its error reaches the fetching thread; a deadline or a
cancel stops it too; and `run` never returns while a lane still works on a chunk (it could
still be writing into a slot)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvcr_core.peers.lanes import LaneJob, ReadLanes

pytestmark = pytest.mark.unit


@pytest.fixture
def lanes() -> Iterator[ReadLanes]:
    bound: list[str] = []
    started = ReadLanes(2, bind=lambda: bound.append(threading.current_thread().name))
    started.start()
    assert bound == ["kvcr-lane-0", "kvcr-lane-1"]  # one after the other, each first thing
    yield started
    started.close()


def test_every_chunk_is_done_once_by_the_lanes_together(lanes: ReadLanes) -> None:
    """Risk: two lanes take the same chunk (a slot written twice, a chunk hashed mid-copy),
    one is skipped (its blocks never published), or the fetching thread READs too (its UCX
    worker may be a lane's)."""
    done: list[tuple[int, str]] = []

    def work(n: int) -> list[int]:
        time.sleep(0.002)  # long enough for both lanes to join in
        done.append((n, threading.current_thread().name))
        return [n]

    job = LaneJob(40, work)
    lanes.run(job, time.monotonic() + 10)
    assert sorted(n for n, _ in done) == list(range(40))
    assert job.digests == [[n] for n in range(40)]
    assert {name for _, name in done} == {"kvcr-lane-0", "kvcr-lane-1"}


def test_a_failed_chunk_stops_the_job_and_run_waits_for_the_others(lanes: ReadLanes) -> None:
    """Risk: the fetching thread returns (and frees the fetch's slots) while a lane is still
    inside a READ, or a lane's error is lost and its chunk counted as read."""
    slow_started = threading.Event()
    finished: list[int] = []

    def work(n: int) -> list[int]:
        if n == 0:
            slow_started.set()
            time.sleep(0.3)  # a READ that takes a while
            finished.append(n)
            return [n]
        slow_started.wait(5)
        raise ConnectionError(f"chunk {n}: the source went away")

    job = LaneJob(10, work)
    with pytest.raises(ConnectionError, match="the source went away"):
        lanes.run(job, time.monotonic() + 10)
    assert finished == [0]  # finished before run returned
    assert job.digests[0] == [0] and all(got is None for got in job.digests[1:])


def test_a_deadline_or_a_cancel_stops_claiming_and_says_which(lanes: ReadLanes) -> None:
    """Risk: a fetch outlives its deadline waiting for chunks nobody started, a cancelled one
    keeps reading, or a deadline that cut a fetch short is not reported."""
    def work(n: int) -> list[int]:
        time.sleep(0.05)
        return [n]

    job = LaneJob(200, work)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        lanes.run(job, started + 0.3)
    assert time.monotonic() - started < 1.0
    done = [n for n, got in enumerate(job.digests) if got is not None]
    assert 2 <= len(done) < 200 and done == list(range(len(done)))

    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    job = LaneJob(200, work)
    lanes.run(job, time.monotonic() + 10, cancel.is_set)  # no error: the caller cancelled
    assert 2 <= sum(got is not None for got in job.digests) < 200

    late = LaneJob(5, work)
    late.stop()
    late.work_on()  # as a lane that dequeues a job after its fetch ended
    assert late.digests == [None] * 5


def test_without_lanes_or_for_one_chunk_the_fetching_thread_does_it() -> None:
    """Risk: with one UCX worker (no lanes) or after close(), a fetch waits for lanes that
    never come; or a one-chunk fetch pays two thread hand-offs for nothing."""
    names: set[str] = set()

    def work(n: int) -> list[int]:
        names.add(threading.current_thread().name)
        return [n]

    for lanes in (ReadLanes(0), ReadLanes(2)):  # the second is never started
        job = LaneJob(8, work)
        lanes.run(job, time.monotonic() + 10)
        assert job.digests == [[n] for n in range(8)]
    started = ReadLanes(2)
    started.start()
    job = LaneJob(1, work)
    started.run(job, time.monotonic() + 10)
    started.close()
    job = LaneJob(3, work)
    started.run(job, time.monotonic() + 10)  # closed: here
    assert job.digests == [[0], [1], [2]] and names == {threading.current_thread().name}


def test_a_lane_that_cannot_bind_stops_them_all() -> None:
    """Risk: a lane that failed to bind to a UCX worker of its own READs anyway, on a worker
    another lane uses (copies that were to run side by side would take turns)."""
    calls = 0

    def bind() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("no worker for this lane")

    lanes = ReadLanes(2, bind)
    with pytest.raises(RuntimeError, match="no worker"):
        lanes.start()
    names: set[str] = set()
    job = LaneJob(4, lambda n: names.add(threading.current_thread().name) or [n])
    lanes.run(job, time.monotonic() + 10)
    assert names == {threading.current_thread().name}


def test_the_engine_has_two_lanes_where_two_cpus_can_run_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: on a one-CPU container two lanes would only take turns (and a second UCX worker
    would cost memory and connections for nothing); a lane count of 0 would READ nothing."""
    from kvcr_core.peers import nixl_engine

    monkeypatch.setattr(nixl_engine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert nixl_engine.NixlEngine().lanes == 2
    monkeypatch.setattr(nixl_engine.os, "sched_getaffinity", lambda pid: {3})
    assert nixl_engine.NixlEngine().lanes == 1
    with pytest.raises(ValueError, match="at least one lane"):
        nixl_engine.NixlEngine(lanes=0)
