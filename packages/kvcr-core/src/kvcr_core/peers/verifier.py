"""`Verifier`: checks fetched blocks against their source's checksums on a thread of its own.

Why: where NIXL copies inside the reader's call (UCX cma on one host, and any transport whose
copy runs on the reader's core), a reader that hashed each chunk itself would alternate copy
and hash on one core. Handing each chunk to this thread lets the hash of one chunk run on
another core while the next chunk is copied (NIXL's post and xxh3 both release the GIL).

Results come back through a `Checks` handle that the reader waits on, bounded by its
deadline (views are made by the thread that hashes, off the reader's path); a reader with
nothing left to read may `run()` a handle itself (whichever thread claims it first hashes
it, once). The reader alone publishes, so a fetch that fails, is
cancelled or times out simply never collects its remaining checks, and nothing unverified
becomes READY.

Bounded: at most `max_pending` chunks wait for the thread (beyond that a reader checks its
chunk itself). Threading: one daemon thread, started on first use and stopped by
`close()`; after `close()` checks run in the caller. The memory `view` returns must stay mapped
until `close()` returns: the owner closes its verifier before its pool.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvcr_core.peers.protocol import checksum


class Checks:
    """The verdicts on one chunk of blocks, in the order they were submitted."""

    __slots__ = ("_blocks", "_claim", "_done", "_expected", "_ok", "_view")

    def __init__(self, view: Callable[[Any], memoryview], blocks: Sequence[Any],
                 expected: Sequence[int]) -> None:
        self._view = view
        self._blocks = blocks
        self._expected = expected
        self._ok: list[bool] = []
        self._claim = threading.Lock()
        self._done = threading.Lock()  # held until the verdicts are known (cheaper than an
        self._done.acquire()  # Event, and made once per chunk on the reader's path)

    def run(self) -> None:
        """Hashes the chunk, unless another thread has begun to: the verifier thread and the
        reader (helping once it has nothing left to read) may both try; whoever claims it
        first does it."""
        if not self._claim.acquire(blocking=False):
            return
        try:
            view = self._view
            self._ok = [checksum(view(block)) == want
                        for block, want in zip(self._blocks, self._expected, strict=True)]
        except Exception:
            self._ok = []
        self._blocks = ()  # the slots are the reader's again
        self._done.release()

    def known(self) -> bool:
        """Whether the verdicts are in (for the thread that calls `wait`)."""
        return not self._done.locked()

    def wait(self, deadline: float) -> list[bool]:
        """Each block's verdict; raises TimeoutError if they are not known by `deadline`."""
        if not self._done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError("deadline passed while verifying checksums")
        self._done.release()
        if len(self._ok) != len(self._expected):
            return [False] * len(self._expected)  # the hash itself failed: nothing is kept
        return self._ok


class Verifier:
    def __init__(self, max_pending: int = 64) -> None:
        self.max_pending = max_pending
        self._queue: queue.SimpleQueue[Checks | None] = queue.SimpleQueue()  # ~1 us a put
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, checks: Checks) -> None:
        """Queues a chunk's checks for the thread. With `max_pending` chunks already waiting
        (or after `close()`) the caller runs them itself, so a reader never waits for room."""
        with self._lock:
            queued = not self._closed and self._queue.qsize() < self.max_pending
            if queued and self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="kvcr-verify",
                                                daemon=True)
                self._thread.start()
        if queued:
            self._queue.put(checks)
        else:
            checks.run()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops the thread once the chunks already queued are checked."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)

    def _serve(self) -> None:
        while (checks := self._queue.get()) is not None:
            checks.run()
