"""The copy-engine seam: how KV bytes move between an engine's KV tensors and the mapped pool.

Owns the plan (runs of consecutive blocks and slots: one strided copy per run and plane, as
`block_pairs` lays them out; each pair also names the call it came from, so an engine may
batch whole calls instead: `batch_copies` turns complete calls that share planes, pool rows
and direction into one `Gather` of all their blocks in slot order, which the CUDA engine
carries out as one gather on the device and a few large DMAs) and the engines that carry it
out, behind one small interface:

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
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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


class BlockCopy:
    """One call's worth of copies: blocks to (or from) slots over the given planes and pool
    rows, checked once (ValueError for a block or slot out of range, before anything is
    copied). `pairs()` plans them run by run; an engine that takes whole calls (`copy_blocks`)
    may plan them its own way. `pairs()`' pairs refer to their call; it does not refer to
    them, so no cycle keeps a pool view alive."""

    __slots__ = ("block_ids", "count", "into_pool", "planes", "rows", "runs", "slots")

    def __init__(self, planes: Sequence[Plane], rows: torch.Tensor, block_ids: Sequence[int],
                 slots: Sequence[int], into_pool: bool) -> None:
        num_blocks = planes[0][0].shape[0] if planes else 0
        if any(not 0 <= b < num_blocks for b in block_ids):
            raise ValueError(f"block ids {list(block_ids)} outside the KV cache's {num_blocks}")
        if any(not 0 <= s < rows.shape[0] for s in slots):
            raise ValueError(f"slots {list(slots)} outside the pool's {rows.shape[0]}")
        self.planes, self.rows, self.into_pool = list(planes), rows, into_pool
        self.block_ids, self.slots = list(block_ids), list(slots)
        self.runs = list(runs(block_ids, slots))
        self.count = len(self.runs) * len(planes)  # copies run by run

    def pairs(self) -> list[Pair]:
        """One (destination, source) pair per run and plane: the run's pages of the plane
        and the same bytes of its slots."""
        columns = [(plane, self.rows[:, offset:offset + page])
                   for plane, offset, page in self.planes]
        pairs: list[Pair] = []
        for block, slot, n in self.runs:
            for plane, column in columns:
                kv, pool = plane[block:block + n], column[slot:slot + n]
                pair = RunPair((pool, kv) if self.into_pool else (kv, pool))
                pair.batch = self
                pairs.append(pair)
        return pairs


class RunPair(tuple["torch.Tensor", "torch.Tensor"]):
    """A (destination, source) pair of `block_pairs`; `batch` is the call it belongs to."""

    batch: BlockCopy


def block_pairs(planes: Sequence[Plane], rows: torch.Tensor, block_ids: Sequence[int],
                slots: Sequence[int], *, into_pool: bool) -> list[Pair]:
    """One (destination, source) pair per run and plane: the run's pages of the plane and
    the same bytes of its slots (`rows`: the pool as [slots, stride bytes]). Raises
    ValueError for a block or slot out of range, before anything is copied."""
    return BlockCopy(planes, rows, block_ids, slots, into_pool).pairs()


def copy_blocks(engine: CopyEngine, planes: Sequence[Plane], rows: torch.Tensor,
                groups: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                into_pool: bool) -> None:
    """`engine.copy` of every (block ids, slots) group's `block_pairs`, as one engine call,
    without planning pairs where the engine takes whole calls (`copy_blocks`: the CUDA
    engine gathers them; planning a pair costs microseconds of Python, a 32 KiB page's DMA
    under one). Raises ValueError for a group out of range before anything is issued."""
    copy_calls(engine, [BlockCopy(planes, rows, b, s, into_pool) for b, s in groups])


def copy_calls(engine: CopyEngine, calls: Sequence[BlockCopy]) -> None:
    """`copy_blocks` of calls checked already (each `BlockCopy` raised for its own range:
    a caller with several requests' blocks fails the bad one alone), as one engine call."""
    whole: Callable[[list[BlockCopy]], None] | None = getattr(engine, "copy_blocks", None)
    if whole is not None:
        whole(list(calls))
    else:
        engine.copy([pair for call in calls for pair in call.pairs()])


@dataclass
class Gather:
    """The blocks of whole calls that share planes (back to back in a slot from `offset`,
    `span` bytes together), pool rows and direction, in slot order; `calls` are those calls
    (`given`: their pairs, where the caller planned them already)."""

    planes: list[Plane]
    rows: torch.Tensor
    into_pool: bool
    block_ids: list[int]
    slots: list[int]
    offset: int
    span: int
    calls: list[BlockCopy]
    given: list[Pair] | None = None

    @property
    def copies(self) -> int:
        """Copies run by run."""
        return sum(call.count for call in self.calls)

    def pairs(self) -> list[Pair]:
        """The same copies run by run."""
        if self.given is not None:
            return self.given
        return [pair for call in self.calls for pair in call.pairs()]

    def slot_runs(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(index, first slot, length) of runs of consecutive slots in [start, stop)."""
        i = start
        while i < stop:
            j = i + 1
            while j < stop and self.slots[j] == self.slots[j - 1] + 1:
                j += 1
            yield i, self.slots[i], j - i
            i = j


def _span(planes: Sequence[Plane]) -> tuple[int, int] | None:
    """(first offset, bytes) if the planes lie back to back in a slot, else None."""
    ordered = sorted((offset, page) for _, offset, page in planes)
    if not ordered or any(o + p != nxt for (o, p), (nxt, _) in itertools.pairwise(ordered)):
        return None
    return ordered[0][0], ordered[-1][0] + ordered[-1][1] - ordered[0][0]


def _key(call: BlockCopy) -> tuple[object, ...]:
    r = call.rows
    return (call.into_pool, r.data_ptr(), tuple(r.shape), tuple(r.stride()),
            tuple((p.data_ptr(), tuple(p.shape), tuple(p.stride()), o, n)
                  for p, o, n in call.planes))


def gathers(items: Sequence[BlockCopy | Pair], given: dict[int, list[Pair]] | None = None
            ) -> list[Gather | BlockCopy | Pair]:
    """Whole calls merged into gathers where they share planes, rows and direction, in order
    of first appearance, pairs as they are; a call whose planes leave gaps in a slot stays
    as it is, and a gather whose blocks or slots repeat goes back to its calls (order
    matters there, and runs keep it). `given`: pairs already planned, by id of their call."""
    out: list[Gather | BlockCopy | Pair] = []
    merged: dict[tuple[object, ...], Gather] = {}
    for call in items:
        span = _span(call.planes) if isinstance(call, BlockCopy) else None
        if not isinstance(call, BlockCopy) or span is None:
            out.append(call)
            continue
        mine = given.get(id(call)) if given is not None else None
        if (shared := _key(call)) in merged:
            g = merged[shared]
            g.block_ids += call.block_ids
            g.slots += call.slots
            g.calls.append(call)
            g.given = g.given + mine if g.given is not None and mine is not None else None
            continue
        merged[shared] = Gather(sorted(call.planes, key=lambda p: p[1]), call.rows,
                                call.into_pool, list(call.block_ids), list(call.slots),
                                span[0], span[1], [call], mine)
        out.append(merged[shared])
    return [x for item in out for x in _ordered(item)]


def _ordered(item: Gather | BlockCopy | Pair) -> list[Gather | BlockCopy | Pair]:
    if not isinstance(item, Gather):
        return [item]
    if len(set(item.slots)) != len(item.slots) or len(set(item.block_ids)) != len(
            item.block_ids):
        return list(item.calls)
    order = sorted(range(len(item.slots)), key=item.slots.__getitem__)
    item.slots = [item.slots[i] for i in order]
    item.block_ids = [item.block_ids[i] for i in order]
    return [item]


def batch_copies(pairs: Sequence[Pair]) -> list[Gather | Pair]:
    """`pairs` as gathers where whole `block_pairs` calls are there (see `gathers`), every
    other pair as it is, in order of first appearance."""
    calls: dict[int, tuple[BlockCopy, list[Pair]]] = {}
    for pair in pairs:
        call: BlockCopy | None = getattr(pair, "batch", None)
        if call is not None:
            calls.setdefault(id(call), (call, []))[1].append(pair)
    given = {key: mine for key, (call, mine) in calls.items()
             if len({id(p) for p in mine}) == call.count}
    items: list[BlockCopy | Pair] = []
    for pair in pairs:
        key = id(getattr(pair, "batch", None))
        if key not in given:
            items.append(pair)
        elif key in calls:  # a whole call in place of its first pair
            items.append(calls.pop(key)[0])
    out: list[Gather | Pair] = []
    for item in gathers(items, given):
        if isinstance(item, BlockCopy):
            out += given[id(item)]
        else:
            out.append(item)
    return out


class Attachable(Protocol):
    """What `PoolBinding` needs of an attachment (a `RunnerOps`)."""

    def pool(self, ns: int = 0) -> SlotPool: ...

    @property
    def attach_count(self) -> int: ...


class PoolBinding:
    """An attachment's pools (one per namespace) as [slots, stride bytes] uint8 rows for one
    engine, each pinned once per attach, on first use. After a re-attach, the previous
    mappings are unpinned (their copies waited for) before this object lets go of them, so a
    mapping is never unmapped while registered with CUDA; `release` does the same before the
    caller closes the attachment. Copies that use the rows are issued inside `use()`, under
    the lock a release takes, so no copy is issued between a release's wait and its
    unregistering."""

    def __init__(self, engine: CopyEngine, client: Attachable,
                 on_pin_failed: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self._client = client
        self._on_pin_failed = on_pin_failed
        self._lock = threading.RLock()
        self._pinned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # ns: (flat, rows)
        self._attach = -1

    @contextlib.contextmanager
    def use(self, ns: int = 0) -> Iterator[torch.Tensor]:
        """Namespace `ns`'s rows of the current attachment (attaches if needed:
        RunnerUnavailable)."""
        with self._lock:
            pool = self._client.pool(ns)
            if self._attach != self._client.attach_count:
                self._drop()
                self._attach = self._client.attach_count
            pinned = self._pinned.get(ns)
            if pinned is None:
                failures = self.engine.pin_failures
                flat = self.engine.pin_pool(pool.region)
                pinned = (flat, flat[:pool.capacity_slots * pool.stride_bytes].view(
                    pool.capacity_slots, pool.stride_bytes))
                self._pinned[ns] = pinned
                if self.engine.pin_failures > failures and self._on_pin_failed is not None:
                    self._on_pin_failed()
            yield pinned[1]

    def release(self) -> None:
        """Waits for copies in flight and unpins; the attachment may then be closed."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        pinned, self._pinned = self._pinned, {}
        for flat, _ in pinned.values():
            self.engine.unpin_pool(flat)  # first: the views keep the mapping alive
