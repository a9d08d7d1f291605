"""`ReadLanes`: threads that READ and hash a NIXL fetch's chunks beside the fetching thread.

Why: where the copy runs in the thread that posts a READ (UCX cma on one host: one kernel
copy inside `transfer()`), one thread copies at about 4 GB/s here, while memory serves two
such copies at once (7.3 GB/s for two threads on this 2-core VM); and a chunk's xxh3 is
cheapest right after its copy, on the same core, while the bytes are still in its cache. So
the fetching thread and the lane threads each take the next chunk of a fetch, READ it and
hash it, side by side. (Each lane READs on a UCX worker of its own: `NixlEngine` keeps one
per lane and UCX binds a READ to the worker of the thread that makes it.)

A `LaneJob` is one fetch's chunks: `work(n)` reads and hashes chunk n and returns its
digests (None: not done, e.g. the fetch was cancelled; `work` stops the job then).
`ReadLanes.run(job)` offers the job to the lane threads and works on it in the calling thread
too; each thread claims the next unclaimed chunk until none is left or the job is stopped
(`stop()`, or a chunk that failed: `run` re-raises its error). `run` returns only once every
claimed chunk is finished, so nothing writes into a slot afterwards; `work` must honour the
fetch's deadline (every NIXL wait does).

Bounded: `helpers` threads, started on first use and stopped by `close()`; a job waits in
their queue only while its fetch runs (a helper that takes it after the fetching thread has
claimed every chunk finds nothing to do). With no helpers (one lane) or after `close()`, the
calling thread does every chunk.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


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
                    if not self._busy:
                        self._state.notify_all()

    def wait_idle(self) -> None:
        """Returns once no chunk is being worked on (each `work` is bounded by the fetch's
        deadline, so this is too)."""
        with self._state:
            while self._busy:
                self._state.wait()


class ReadLanes:
    def __init__(self, helpers: int) -> None:
        self.helpers = max(0, helpers)
        self._queue: queue.SimpleQueue[LaneJob | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def run(self, job: LaneJob) -> None:
        """Does `job` on this thread and the helpers; returns when no chunk is being worked on
        any more. Re-raises the first error a chunk raised (the job stops at it)."""
        with self._lock:
            offered = not self._closed and self.helpers > 0
            if offered and not self._threads:
                for i in range(self.helpers):
                    thread = threading.Thread(target=self._serve, name=f"kvcr-lane-{i + 1}",
                                              daemon=True)
                    thread.start()
                    self._threads.append(thread)
        if offered:
            for _ in range(self.helpers):
                self._queue.put(job)
        try:
            job.work_on()
        except BaseException:
            job.stop()
            raise
        finally:
            job.wait_idle()
        if job.error is not None:
            raise job.error

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops the helpers once the jobs already offered are done."""
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join(timeout_s)

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            job.work_on()
