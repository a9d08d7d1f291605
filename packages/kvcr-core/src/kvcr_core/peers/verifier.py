"""`Verifier`: checks fetched blocks against their source's checksums on a thread of its own.

Why: where NIXL copies inside the reader's call (UCX cma on one host, and any transport whose
copy runs on the reader's core), a reader that hashed each chunk itself would alternate copy
and hash on one core. Handing each chunk to this thread lets the hash of one chunk run on
another core while the next chunk is copied (NIXL's post and xxh3 both release the GIL).

Results come back through a `Checks` handle that the reader waits on, bounded by its
deadline; a reader with nothing left to read may `run()` a handle itself (whichever thread
claims it first hashes it, once). The reader alone publishes, so a fetch that fails, is
cancelled or times out simply never collects its remaining checks, and nothing unverified
becomes READY.

Bounded: at most `max_pending` chunks wait for the thread (a reader blocks, within its
deadline, beyond that). Threading: one daemon thread, started on first use and stopped by
`close()`; after `close()` checks run in the caller. The views handed in must stay mapped until
`close()` returns: the owner closes its verifier before its pool.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

from kvcr_core.peers.protocol import checksum


class Checks:
    """The verdicts on one chunk of blocks, in the order they were submitted."""

    __slots__ = ("_claim", "_done", "_expected", "_ok", "_views")

    def __init__(self, views: Sequence[memoryview], expected: Sequence[int]) -> None:
        self._views = views
        self._expected = expected
        self._ok: list[bool] = []
        self._claim = threading.Lock()
        self._done = threading.Event()

    def run(self) -> None:
        """Hashes the chunk, unless another thread has begun to: the verifier thread and the
        reader (helping once it has nothing left to read) may both try; whoever claims it
        first does it."""
        if not self._claim.acquire(blocking=False):
            return
        try:
            self._ok = [checksum(view) == want
                        for view, want in zip(self._views, self._expected, strict=True)]
        except Exception:
            self._ok = []
        self._views = ()  # the slots are the reader's again
        self._done.set()

    def known(self) -> bool:
        return self._done.is_set()

    def wait(self, deadline: float) -> list[bool]:
        """Each block's verdict; raises TimeoutError if they are not known by `deadline`."""
        if not self._done.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("deadline passed while verifying checksums")
        if len(self._ok) != len(self._expected):
            return [False] * len(self._expected)  # the hash itself failed: nothing is kept
        return self._ok


def check_here(views: Sequence[memoryview], expected: Sequence[int],
               deadline: float = 0.0) -> Checks:
    """Checks a chunk in the caller (a fetch of one chunk, or after `close()`); same signature
    as `Verifier.submit`."""
    checks = Checks(views, expected)
    checks.run()
    return checks


class Verifier:
    def __init__(self, max_pending: int = 64) -> None:
        self._queue: queue.Queue[Checks | None] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, views: Sequence[memoryview], expected: Sequence[int],
               deadline: float) -> Checks:
        """Queues a chunk for checking; raises TimeoutError if the queue stays full past
        `deadline`."""
        with self._lock:
            if self._closed:
                return check_here(views, expected)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="kvcr-verify",
                                                daemon=True)
                self._thread.start()
        checks = Checks(views, expected)
        try:
            self._queue.put(checks, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            raise TimeoutError("deadline passed waiting for the checksum verifier") from None
        return checks

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
