"""`ThreadedCopyEngine`: a copy engine whose CPU copies complete later, on a helper thread, in
the order they were issued, as a GPU's stream completes them. For tests only (on CPU a copy
thread is far slower than inline copies): it lets CPU tests check the rules a GPU imposes, with
the test in control of time and faults:

- `hold()` / `release()`: the helper thread stops before its next item until released, so a
  test sees what a caller does while copies are still in flight;
- `fail_next_copy()`: the next `copy` call fails when the helper thread runs it, so the next
  job recorded after it fails (`CopyFailed`), as a CUDA event would after a copy error;
- `fail_pin = True`: `pin_pool` counts a pin failure (and still returns the mapping);
- `log`: ("pin", address), ("unpin", address) and ("unmap", address), the last when the
  mapping's memory is unmapped (its mmap object goes), so tests can check the order.

Threading: `copy` and `record` may be called from any thread; the log is appended under the GIL.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcr_core.copyengine import CopyFailed, CopyJob
from kvcr_core.memory import HostRegion

if TYPE_CHECKING:
    import torch

_Copies = tuple[list[tuple["torch.Tensor", "torch.Tensor"]], bool]  # (pairs, fail them)
_WAIT_S = 30.0  # a job no test releases in this long is a test bug: fail instead of hanging


class ThreadJob:
    """Completes when the helper thread reaches it; failed if a copy before it failed."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self._error = error
        self._event.set()

    def done(self) -> bool:
        if not self._event.is_set():
            return False
        if self._error is not None:
            raise CopyFailed(f"copy failed: {self._error}") from self._error
        return True

    def wait(self) -> None:
        if not self._event.wait(_WAIT_S):
            raise CopyFailed(f"copy did not complete in {_WAIT_S} s (is the engine held?)")
        self.done()


class ThreadedCopyEngine:
    asynchronous = True

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.pin_failures = 0
        self.fail_pin = False
        self.fences = 0
        self._fail_next = False
        self._failure: BaseException | None = None
        self._gate = threading.Event()
        self._gate.set()
        self._queue: queue.Queue[_Copies | ThreadJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvcr-test-copies")
        self._thread.start()

    # -- test controls ---------------------------------------------------------------------

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def fail_next_copy(self) -> None:
        self._fail_next = True

    def drain(self) -> None:
        """Waits until everything issued so far ran (release a held engine first)."""
        self.record().wait()

    def close(self) -> None:
        self._gate.set()
        self._queue.put(None)
        self._thread.join(timeout=_WAIT_S)

    # -- the engine ------------------------------------------------------------------------

    def pin_pool(self, region: HostRegion) -> torch.Tensor:
        import torch

        flat = torch.frombuffer(region.view, dtype=torch.uint8)
        address = flat.data_ptr()
        mapping = region._map  # the mmap object: the memory is unmapped when it goes
        assert mapping is not None
        weakref.finalize(mapping, self.log.append, ("unmap", address))
        if self.fail_pin:
            self.pin_failures += 1
        else:
            self.log.append(("pin", address))
        return flat

    def unpin_pool(self, pool: torch.Tensor) -> None:
        self.drain()
        self.log.append(("unpin", pool.data_ptr()))

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        fail, self._fail_next = self._fail_next, False
        self._queue.put((list(pairs), fail))

    def record(self) -> CopyJob:
        job = ThreadJob()
        self._queue.put(job)
        return job

    def fence(self) -> None:
        self.fences += 1

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._gate.wait()
            if isinstance(item, ThreadJob):
                item.finish(self._failure)
                self._failure = None
            else:
                self._execute(*item)
            item = None  # hold no view of a pool between items (it would delay its unmap)

    def _execute(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], fail: bool) -> None:
        try:
            if fail:
                raise CopyFailed("an injected copy failure")
            for dst, src in pairs:
                dst.copy_(src)
        except Exception as exc:  # reported by the next job, as a stream error would be
            self._failure = exc.with_traceback(None)  # no frame (and no pool view) kept
