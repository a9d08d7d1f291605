"""The copy-engine seam: how KV bytes move between an engine's KV tensors and the mapped pool.

Owns the plan (runs of consecutive blocks and slots: one strided copy per run and plane, as
`block_pairs` lays them out) and the engines that carry it out, behind one small interface:

- `CpuCopyEngine`: `Tensor.copy_` inline, finished when `copy` returns. On CPU a copy thread
  was measured 5-100x slower (starved by the engine's OpenMP threads), so copies stay inline.
- `CudaCopyEngine` (kvcr_core.cudacopy, loaded only for a CUDA device): the pool mapping
  registered with CUDA, copies on a stream of its own, an event per `record`.
- `ThreadedCopyEngine` (kvcr_core.testing): CPU copies completed later on a helper thread, so
  CPU tests exercise the ordering rules a GPU imposes.

Contract of every engine: `copy` issues copies (an issue failure raises: nothing of that call
is trusted); `record` returns a `CopyJob` that completes once everything issued before it did,
and whose `done` (a poll, never blocking) and `wait` raise `CopyFailed` if any of those copies
failed. Callers publish (commit) saved blocks, and report loads finished, only after their
job completed. `fence` orders the caller's later device work (its current stream) after the
copies issued so far, without blocking the host (no-op on CPU). `pin_pool` views a pool
mapping as one uint8 tensor (pinned for DMA where the engine can); `unpin_pool` waits for
the copies in flight and unregisters it: call it before the mapping may be unmapped
(`PoolBinding` does, for an attachment that may re-attach).

kvcr-core's torch seam: this module and kvcr_core.cudacopy (and the test engine,
kvcr_core.testing.copies) are the only ones that import torch, lazily here; an import
contract allows these and no other. Threading: an engine
may be shared by threads (CUDA streams are); `PoolBinding` is thread-safe.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from kvcr_core.memory import HostRegion, SlotPool

if TYPE_CHECKING:
    import torch

    Pair = tuple[torch.Tensor, torch.Tensor]  # (destination, source)
    Plane = tuple[torch.Tensor, int, int]  # (KV bytes [blocks, page], offset in slot, page)


class CopyFailed(RuntimeError):
    """A copy between the KV cache and the pool did not complete: its blocks must not be
    published (saves) or used (loads)."""


class CopyJob(Protocol):
    def done(self) -> bool:
        """Whether every copy the job covers completed (never blocks; raises CopyFailed)."""

    def wait(self) -> None:
        """Blocks until every copy the job covers completed (raises CopyFailed)."""


class CopyEngine(Protocol):
    @property
    def asynchronous(self) -> bool:
        """Whether copies may complete after `copy` returns (then saves go layer by layer)."""

    @property
    def pin_failures(self) -> int:
        """Pool mappings that could not be pinned (their copies are pageable: slower)."""

    def pin_pool(self, region: HostRegion) -> torch.Tensor: ...

    def unpin_pool(self, pool: torch.Tensor) -> None: ...

    def copy(self, pairs: Sequence[Pair]) -> None: ...

    def record(self) -> CopyJob: ...

    def fence(self) -> None: ...


class DoneJob:
    """A job that completed when it was made (synchronous engines)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = DoneJob()


class CpuCopyEngine:
    """Today's copies: `copy_` inline, in the caller's thread."""

    asynchronous = False
    pin_failures = 0

    def pin_pool(self, region: HostRegion) -> torch.Tensor:
        import torch

        return torch.frombuffer(region.view, dtype=torch.uint8)

    def unpin_pool(self, pool: torch.Tensor) -> None:
        return None

    def copy(self, pairs: Sequence[Pair]) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    def record(self) -> CopyJob:
        return DONE

    def fence(self) -> None:
        return None


def engine_for(device: torch.device) -> CopyEngine:
    """The engine for KV tensors on `device`: CUDA's own, else inline copies."""
    if device.type == "cuda":
        from kvcr_core.cudacopy import CudaCopyEngine

        return CudaCopyEngine(device)
    return CpuCopyEngine()


def runs(block_ids: Sequence[int], slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(first block, first slot, length) of maximal runs where both advance by one."""
    i, n = 0, len(block_ids)
    while i < n:
        j = i + 1
        while j < n and block_ids[j] == block_ids[j - 1] + 1 and slots[j] == slots[j - 1] + 1:
            j += 1
        yield block_ids[i], slots[i], j - i
        i = j


def block_pairs(planes: Sequence[Plane], rows: torch.Tensor, block_ids: Sequence[int],
                slots: Sequence[int], *, into_pool: bool) -> list[Pair]:
    """One (destination, source) pair per run and plane: the run's pages of the plane and
    the same bytes of its slots (`rows`: the pool as [slots, stride bytes]). Raises
    ValueError for a block or slot out of range, before anything is copied."""
    num_blocks = planes[0][0].shape[0] if planes else 0
    if any(not 0 <= b < num_blocks for b in block_ids):
        raise ValueError(f"block ids {list(block_ids)} outside the KV cache's {num_blocks}")
    if any(not 0 <= s < rows.shape[0] for s in slots):
        raise ValueError(f"slots {list(slots)} outside the pool's {rows.shape[0]}")
    pairs: list[Pair] = []
    for block, slot, n in runs(block_ids, slots):
        for plane, offset, page in planes:
            kv, pool = plane[block:block + n], rows[slot:slot + n, offset:offset + page]
            pairs.append((pool, kv) if into_pool else (kv, pool))
    return pairs


class Attachable(Protocol):
    """What `PoolBinding` needs of an attachment (a `RunnerOps`: its first namespace)."""

    def pool(self, ns: int = 0) -> SlotPool: ...

    @property
    def attach_count(self) -> int: ...


class PoolBinding:
    """An attachment's pool as [slots, stride bytes] uint8 rows for one engine, pinned once
    per attach. After a re-attach, the previous mapping is unpinned (its copies waited for)
    before this object lets go of it, so a mapping is never unmapped while registered with
    CUDA; `release` does the same before the caller closes the attachment. Copies that use
    the rows are issued inside `use()`, under the lock a release takes, so no copy is issued
    between a release's wait and its unregistering."""

    def __init__(self, engine: CopyEngine, client: Attachable,
                 on_pin_failed: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self._client = client
        self._on_pin_failed = on_pin_failed
        self._lock = threading.RLock()
        self._flat: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._attach = -1

    @contextlib.contextmanager
    def use(self) -> Iterator[torch.Tensor]:
        """The rows of the current attachment (attaches if needed: RunnerUnavailable)."""
        with self._lock:
            pool = self._client.pool()
            if self._rows is None or self._attach != self._client.attach_count:
                self._drop()
                failures = self.engine.pin_failures
                flat = self.engine.pin_pool(pool.region)
                self._flat = flat
                self._rows = flat[:pool.capacity_slots * pool.stride_bytes].view(
                    pool.capacity_slots, pool.stride_bytes)
                self._attach = self._client.attach_count
                if self.engine.pin_failures > failures and self._on_pin_failed is not None:
                    self._on_pin_failed()
            yield self._rows

    def release(self) -> None:
        """Waits for copies in flight and unpins; the attachment may then be closed."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._flat is not None:
            self.engine.unpin_pool(self._flat)  # first: the views keep the mapping alive
        self._flat = self._rows = None
