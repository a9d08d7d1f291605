"""`ReadLanes`: the threads that READ and hash a NIXL fetch's chunks side by side.

Why: where the copy runs in the thread that posts a READ (UCX cma on one host: one kernel
copy inside `transfer()`), one thread copies at about 4 GB/s here, while memory serves two
such copies at once (7.3 GB/s for two threads on this 2-core VM); and a chunk's xxh3 is
cheapest right after its copy, on the same core, while the bytes are still in its cache. So
each lane takes the next chunk of a fetch, READs it and hashes it. Two lanes copy at once only
on two UCX workers, and UCX binds a thread to a worker when it first makes a transfer (the
next worker in turn): so the lanes belong to the process's `NixlEngine`, which starts them
one after another, each `bind`ing itself before the next starts and before any other thread
can reach the agent. Threads outside the lanes (a fetch's own) never READ when there are
lanes, so no two copies meet on one worker.

A `LaneJob` is one fetch's chunks: `work(n)` reads and hashes chunk n and returns its
digests (None: not done, e.g. the fetch was cancelled; `work` stops the job then). `run`
offers the job to every lane and waits until every chunk is done, the job is stopped (by
`work`, or a chunk that failed: `run` re-raises its error), the caller's `stopped()` says so,
or the deadline passes (TimeoutError if chunks were left); in every case it returns only once
no lane works on the job any more, so nothing writes into a slot afterwards. `work` must
honour the fetch's deadline (every NIXL wait does). With no lane threads (one lane), or a
single chunk, `run` does the chunks in the calling thread (whose READ may then share a worker
with a lane's: UCX serialises the two, which is correct, only not parallel).

Bounded: the lane threads (one per UCX worker) live as long as the process; jobs of fetches
running at once queue for them in order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

_CHECK_STOPPED_S = 0.05  # how often a waiting fetch looks at its cancel flag


class LaneJob:
    """The chunks of one fetch and what became of each (`digests[n]`, None until done)."""

    def __init__(self, chunks: int, work: Callable[[int], list[int] | None]) -> None:
        self.digests: list[list[int] | None] = [None] * chunks
        self.error: BaseException | None = None
        self._work = work
        self._next = 0
        self._end = chunks
        self._busy = 0  # chunks claimed and not yet finished
        self._state = threading.Condition(threading.Lock())

    def stop(self) -> None:
        """No chunk is claimed after this (those being worked on still finish)."""
        with self._state:
            self._end = self._next

    def work_on(self) -> None:
        """Claims and does chunks until none is left (or the job is stopped)."""
        while True:
            with self._state:
                n = self._next
                if n >= self._end:
                    return
                self._next += 1
                self._busy += 1
            try:
                self.digests[n] = self._work(n)
            except BaseException as exc:
                with self._state:
                    self.error = self.error or exc
                    self._end = self._next
            finally:
                with self._state:
                    self._busy -= 1
                    if not self._busy and self._next >= self._end:  # the job is over
                        self._state.notify_all()

    def wait(self, deadline: float, stopped: Callable[[], bool]) -> bool:
        """Waits until no chunk is left to claim or being worked on; stops the job first if
        `deadline` passes or `stopped()` says so. Returns whether every chunk was claimed."""
        with self._state:
            while self._next < self._end or self._busy:
                if self._next < self._end and (time.monotonic() >= deadline or stopped()):
                    self._end = self._next
                    continue
                left = deadline - time.monotonic()
                self._state.wait(max(0.0, min(left, _CHECK_STOPPED_S)) if self._next < self._end
                                 else None)  # only lanes' own bounded work is left: wait it out
            return self._end == len(self.digests)


class ReadLanes:
    def __init__(self, threads: int, bind: Callable[[], None] | None = None) -> None:
        self.threads = max(0, threads)
        self._bind = bind
        self._queue: queue.SimpleQueue[LaneJob | None] = queue.SimpleQueue()
        self._running: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """Starts the lane threads one after another, each running `bind` first; raises what a
        `bind` raised (no lane is left running then)."""
        with self._lock:
            for i in range(self.threads):
                bound = threading.Event()
                failed: list[BaseException] = []
                thread = threading.Thread(target=self._serve, args=(bound, failed),
                                          name=f"kvcr-lane-{i}", daemon=True)
                thread.start()
                bound.wait()
                if failed:
                    self._stop_locked()
                    raise failed[0]
                self._running.append(thread)

    def run(self, job: LaneJob, deadline: float,
            stopped: Callable[[], bool] = lambda: False) -> None:
        """Does `job` on the lanes (or here, without any); see the module docstring."""
        with self._lock:
            lanes = len(self._running)
        if not lanes or len(job.digests) == 1:  # one chunk: nothing to share, no hand-off
            job.work_on()
        else:
            for _ in range(lanes):
                self._queue.put(job)
            if not job.wait(deadline, stopped) and job.error is None and not stopped():
                raise TimeoutError("deadline passed before every chunk was read")
        if job.error is not None:
            raise job.error

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops the lanes once the jobs already offered are done; later jobs run in the
        caller."""
        with self._lock:
            threads = self._stop_locked()
        for thread in threads:
            thread.join(timeout_s)

    def _stop_locked(self) -> list[threading.Thread]:
        threads, self._running = self._running, []
        for _ in threads:
            self._queue.put(None)
        return threads

    def _serve(self, bound: threading.Event, failed: list[BaseException]) -> None:
        try:
            if self._bind is not None:
                self._bind()
        except BaseException as exc:
            failed.append(exc)
            return
        finally:
            bound.set()
        while (job := self._queue.get()) is not None:
            job.work_on()
