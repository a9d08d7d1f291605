"""Batched copies and checked CUDA runtime calls, on CPU. Risks: a gather merges calls that
must stay apart (other planes, other rows, a call handed over in part) or loses the runs'
order where a block or slot repeats; a gathered save or load puts a page in the wrong slot,
offset or block (chunk edges, scattered slots, the zero-copy pool side, unaligned pages);
`auto` gathers where one copy per run is as good; a failed runtime call leaves its error
pending (the next torch kernel of the process would raise it), is not counted, or floods the
log."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch", reason="the copy engines move torch tensors")

from kvcr_core.copyengine import (  # noqa: E402
    CpuCopyEngine,
    Gather,
    batch_copies,
    block_pairs,
    copy_blocks,
)
from kvcr_core.cudacopy import choose, gather_copy  # noqa: E402
from kvcr_core.cudart import CudaRuntime, PoolPins  # noqa: E402
from kvcr_core.memory import SlotPool  # noqa: E402

BLOCKS, PAGE, PLANES = 40, 64, 4


def planes_of(seed: int, page: int = PAGE) -> list[tuple[torch.Tensor, int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (BLOCKS, page), generator=gen, dtype=torch.uint8),
             i * page, page) for i in range(PLANES)]


def rows_of(pool: SlotPool) -> torch.Tensor:
    flat = torch.frombuffer(pool.region.view, dtype=torch.uint8)
    return flat[:pool.capacity_slots * pool.stride_bytes].view(pool.capacity_slots,
                                                                pool.stride_bytes)


def only_gather(items: list[object]) -> Gather:
    assert len(items) == 1 and isinstance(items[0], Gather)
    return items[0]


@pytest.mark.unit
def test_whole_calls_sharing_planes_and_rows_merge_into_one_gather_in_slot_order() -> None:
    """Two saves of one step (same planes, same rows) become one gather sorted by slot, its
    pairs the runs of both; a third call to other rows stays apart."""
    rows, planes = rows_of(SlotPool.create(16, PLANES * PAGE)), planes_of(1)
    first = block_pairs(planes, rows, (7, 8, 2), (5, 6, 1), into_pool=True)
    second = block_pairs(planes, rows, (30,), (0,), into_pool=True)
    other = block_pairs(planes, rows_of(SlotPool.create(4, PLANES * PAGE)), (1,), (1,),
                        into_pool=True)
    items = batch_copies(first + second + other)
    assert len(items) == 2 and all(isinstance(i, Gather) for i in items)
    g = items[0]
    assert isinstance(g, Gather)
    assert (g.slots, g.block_ids) == ([0, 1, 5, 6], [30, 2, 7, 8])
    assert (g.offset, g.span, g.copies) == (0, PLANES * PAGE, len(first) + len(second))
    assert g.pairs() == first + second
    assert list(g.slot_runs(0, 4)) == [(0, 0, 2), (2, 5, 2)]
    assert list(g.slot_runs(1, 3)) == [(1, 1, 1), (2, 5, 1)]


@pytest.mark.unit
def test_a_call_handed_over_in_part_or_with_gaps_or_repeats_stays_run_by_run() -> None:
    """Pairs of a call not all there, planes with a gap between them in the slot, or a slot
    that repeats: the pairs go as they are (gathering would copy bytes not asked for or lose
    the order)."""
    rows, planes = rows_of(SlotPool.create(16, PLANES * PAGE)), planes_of(2)
    part = block_pairs(planes, rows, (1, 2), (3, 9), into_pool=True)[:-1]
    assert batch_copies(part) == part
    gap = block_pairs([planes[0], planes[2]], rows, (1,), (2,), into_pool=True)
    assert batch_copies(gap) == gap
    twice = block_pairs(planes, rows, (1, 4), (2, 2), into_pool=True)
    assert batch_copies(twice) == twice
    one_layer = block_pairs(planes[2:], rows, (1, 5), (2, 8), into_pool=False)
    g = only_gather(batch_copies(one_layer))
    assert (g.offset, g.span, g.into_pool) == (2 * PAGE, 2 * PAGE, False)


def dma(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class LoggedStages:
    """Records which side of which chunk ran, in order (the CUDA engine puts the two sides
    on two streams and orders them by these calls)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def device_side(self, chunk: int) -> Iterator[None]:
        self.log.append(("device", chunk))
        yield

    @contextlib.contextmanager
    def pool_side(self, chunk: int) -> Iterator[None]:
        self.log.append(("pool", chunk))
        yield


@pytest.mark.unit
@pytest.mark.parametrize("zero_copy", [False, True], ids=["dma", "zero-copy"])
@pytest.mark.parametrize("page", [PAGE, 60], ids=["words", "bytes"])
def test_a_gathered_save_and_load_land_byte_exactly(zero_copy: bool, page: int) -> None:
    """Scattered blocks into scattered slots through two staging buffers of 2 blocks (chunk
    edges inside slot runs, the buffers used in turn): every slot holds its block's planes
    at their offsets and nothing else; loading them back into other blocks gives the same
    pages. A save gathers a chunk before its pool side, a load the reverse. 60-byte pages
    take the byte path (no int64 view)."""
    pool = SlotPool.create(24, PLANES * page)
    rows, planes = rows_of(pool), planes_of(3, page)
    blocks, slots = [4, 5, 6, 7, 20, 33, 34, 1], [10, 11, 12, 13, 0, 3, 4, 22]
    g = only_gather(batch_copies(block_pairs(planes, rows, blocks, slots, into_pool=True)))
    buffers = [torch.empty(3 * g.span - 1, dtype=torch.uint8),
               torch.empty(2 * g.span + 7, dtype=torch.uint8)]
    ids, stages = torch.tensor(g.block_ids + g.slots), LoggedStages()
    gather_copy(g, buffers, ids[:8], ids[8:], dma, rows if zero_copy else None, stages)
    assert stages.log == [(side, c) for c in range(4) for side in ("device", "pool")]
    for block, slot in zip(blocks, slots, strict=True):
        want = b"".join(bytes(p[block].numpy()) for p, _, _ in planes)
        assert bytes(pool.view(slot)) == want + bytes(pool.slot_bytes - len(want))
    assert bytes(pool.view(2)) == bytes(pool.slot_bytes)
    back = planes_of(4, page)
    g = only_gather(batch_copies(block_pairs(back, rows, list(range(8)), slots,
                                             into_pool=False)))
    ids, stages = torch.tensor(g.block_ids + g.slots), LoggedStages()
    gather_copy(g, buffers, ids[:8], ids[8:], dma, rows if zero_copy else None, stages)
    assert stages.log == [(side, c) for c in range(4) for side in ("pool", "device")]
    for mine, theirs in zip(back, planes, strict=True):
        assert torch.equal(mine[0][:8], theirs[0][blocks])


@pytest.mark.unit
def test_gathered_copies_match_the_cpu_engines_bytes() -> None:
    """The same save through the CPU engine (run by run) and through a gather leave the same
    pool bytes: a gather is a different schedule, not a different result."""
    planes = planes_of(5)
    blocks, slots = [9, 3, 4, 5, 17], [2, 7, 8, 9, 14]
    by_runs, gathered = SlotPool.create(16, PLANES * PAGE), SlotPool.create(16, PLANES * PAGE)
    CpuCopyEngine().copy(block_pairs(planes, rows_of(by_runs), blocks, slots, into_pool=True))
    g = only_gather(batch_copies(block_pairs(planes, rows_of(gathered), blocks, slots,
                                             into_pool=True)))
    ids = torch.tensor(g.block_ids + g.slots)
    gather_copy(g, [torch.empty(1 << 16, dtype=torch.uint8)], ids[:5], ids[5:], dma)
    assert bytes(by_runs.region.view) == bytes(gathered.region.view)


@pytest.mark.unit
def test_copy_blocks_through_an_engine_without_it_copies_every_group_or_none() -> None:
    """`copy_blocks` on an engine that takes pairs only (the CPU engine): every group's
    blocks land, as `block_pairs` would copy them; a group out of range raises before any
    group is copied."""
    pool = SlotPool.create(16, PLANES * PAGE)
    rows, planes = rows_of(pool), planes_of(7)
    copy_blocks(CpuCopyEngine(), planes, rows, [((3, 4), (9, 10)), ((8,), (2,))],
                into_pool=True)
    for block, slot in ((3, 9), (4, 10), (8, 2)):
        assert bytes(pool.view(slot)) == b"".join(bytes(p[block].numpy()) for p, _, _ in planes)
    with pytest.raises(ValueError, match="slots"):
        copy_blocks(CpuCopyEngine(), planes, rows, [((1,), (0,)), ((2,), (16,))],
                    into_pool=True)
    assert bytes(pool.view(0)) == bytes(pool.slot_bytes)


@pytest.mark.unit
def test_auto_gathers_only_where_runs_would_be_many_small_copies() -> None:
    """Whole 256 KiB blocks in runs of 8 stay one copy per run (2 MiB copies: at link speed on
    an H200), single ones are gathered; so are 32 KiB per-layer pages of scattered blocks,
    not those of 64 consecutive blocks (2 MiB a plane); a forced strategy is kept."""
    page = 32 << 10
    pool = SlotPool.create(64, 8 * page)
    rows = rows_of(pool)
    whole = [(torch.zeros(64, 8 * page, dtype=torch.uint8), 0, 8 * page)]
    paged = [(torch.zeros(64, page, dtype=torch.uint8), i * page, page) for i in range(8)]
    scattered, runs_of_8 = list(range(0, 64, 2)), [b + b // 8 for b in range(32)]
    consecutive = list(range(64))  # 2 MiB a plane

    def plan(planes: list[tuple[torch.Tensor, int, int]], blocks: list[int]) -> Gather:
        return only_gather(batch_copies(block_pairs(planes, rows, blocks,
                                                    range(len(blocks)), into_pool=True)))

    assert choose(plan(whole, runs_of_8), "auto") == "runs"
    assert choose(plan(whole, scattered), "auto") == "gather"
    assert choose(plan(paged, scattered), "auto") == "gather"
    assert choose(plan(paged, consecutive), "auto") == "runs"
    assert choose(plan(paged, consecutive), "direct") == "direct"


class FakeCalls:
    """A libcudart whose calls fail with chosen errors and keep the last one pending, as the
    real runtime does until `cudaGetLastError`."""

    has_memcpy2d = True

    def __init__(self, fail: dict[str, int], *, has_last_error: bool = True) -> None:
        self.fail, self.pending, self.has_last_error = fail, 0, has_last_error
        self.registered: set[int] = set()

    def _result(self, name: str) -> int:
        error = self.fail.get(name, 0)
        self.pending = error or self.pending
        return error

    def host_register(self, address: int, size: int, flags: int) -> int:
        if (error := self._result("register")) == 0:
            self.registered.add(address)
        return error

    def host_unregister(self, address: int) -> int:
        return self._result("unregister")

    def host_device_pointer(self, address: int) -> tuple[int, int]:
        return self._result("pointer"), address

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                       height: int, kind: int, stream: int) -> int:
        return self._result("memcpy2d")

    def get_last_error(self) -> int:
        if not self.has_last_error:
            raise NotImplementedError
        error, self.pending = self.pending, 0
        return error

    def next_kernel(self) -> None:
        """What torch's next launch check does: raise an error left pending."""
        if self.pending:
            raise RuntimeError(f"CUDA error {self.pending}")


@pytest.mark.unit
def test_a_failed_registration_leaves_no_error_pending_and_is_counted_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """cudaHostRegister failing (712, already registered) twice: the mapping stays pageable,
    each failure is cleared at once (the next kernel runs), counted, and logged once."""
    calls = FakeCalls({"register": 712})
    pins = PoolPins(CudaRuntime(calls))
    with caplog.at_level(logging.WARNING, logger="kvcr_core.copies"):
        assert not pins.pin(4096, 1 << 20)
        calls.next_kernel()
        assert not pins.pin(8192, 1 << 20)
    calls.next_kernel()
    assert pins.pin_failures == 2 and pins.runtime.failures == {"cudaHostRegister": 2}
    assert pins.pinned == {} and pins.device_address(4096, 10) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cudaHostRegister failed (cudaError 712" in warnings[0]


@pytest.mark.unit
def test_every_other_runtime_call_clears_its_failure_too() -> None:
    """Unregister, device pointer and strided copy failures: cleared, counted by call name;
    a mapping whose device pointer failed is pinned for DMA but not for zero-copy."""
    calls = FakeCalls({"unregister": 1, "pointer": 201, "memcpy2d": 11})
    runtime = CudaRuntime(calls)
    pins = PoolPins(runtime)
    assert pins.pin(4096, 8192) and pins.device_address(4096, 10) is None
    calls.next_kernel()
    pins.unpin(4096)
    calls.next_kernel()
    assert runtime.memcpy2d_async(1, 2, 3, 4, 5, 6, 0) == 11
    calls.next_kernel()
    assert runtime.failures == {"cudaHostGetDevicePointer": 1, "cudaHostUnregister": 1,
                                "cudaMemcpy2DAsync": 1}
    assert runtime.failures_total == 3 and pins.pinned == {}


@pytest.mark.unit
def test_without_cudagetlasterror_the_callers_clear_runs() -> None:
    """Where the calls have no cudaGetLastError (torch linking libcudart statically), the
    clearing callback runs after each failure; a success needs none."""
    cleared: list[int] = []
    calls = FakeCalls({"register": 2}, has_last_error=False)
    runtime = CudaRuntime(calls, lambda: cleared.append(1))
    assert runtime.host_register(4096, 10, 3) == 2 and cleared == [1]
    assert runtime.host_unregister(4096) == 0 and cleared == [1]


@pytest.mark.unit
def test_a_pinned_mapping_gives_device_addresses_inside_it_only() -> None:
    """The zero-copy view needs the device address of a range; a range reaching past the
    registered mapping (a DMA across two registrations fails) gets none."""
    pins = PoolPins(CudaRuntime(FakeCalls({})))
    assert pins.pin(1 << 20, 1 << 16)
    assert pins.device_address((1 << 20) + 100, 200) == (1 << 20) + 100
    assert pins.device_address((1 << 20) + 100, 1 << 16) is None


class StandInStream:
    cuda_stream = 0

    def __init__(self, *args: object) -> None:
        self.waits = 0

    def wait_stream(self, other: object) -> None:
        self.waits += 1

    def wait_event(self, event: object) -> None:
        self.waits += 1

    def synchronize(self) -> None:
        return None


class StandInEvent:
    def record(self, stream: object = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


@pytest.fixture
def cuda_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaCopyEngine on CPU tensors: streams and events that do nothing (CPU copies finish
    when issued), a fake libcudart, pinned host memory that is plain memory."""
    from kvcr_core import cudacopy

    monkeypatch.setattr(torch.cuda, "Stream", StandInStream)
    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: StandInStream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(cudacopy, "cuda_runtime", lambda device: CudaRuntime(FakeCalls({})))
    tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, pin_memory=False, **k: tensor(*a, **k))


@pytest.mark.unit
@pytest.mark.parametrize("strategy", ["runs", "gather", "direct", "auto"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["paged", "layerwise"])
@pytest.mark.parametrize("entry", ["pairs", "blocks"])
def test_the_cuda_engine_issues_each_strategy_byte_exactly(
        cuda_stand_ins: None, strategy: str, layerwise: bool, entry: str) -> None:
    """The CUDA engine's own path from `copy` (pairs) or `copy_blocks` (whole calls) to its
    strategy, with stand-in streams: two saves per call (merged), one call per layer or one
    for all, scattered blocks and slots in descending order, staging halves of 3 blocks;
    every slot then holds its block, a load brings every block back, and the strategy taken
    is counted."""
    from kvcr_core.cudacopy import CudaCopyEngine

    engine = CudaCopyEngine("cpu", use_memcpy2d=False, strategy=strategy,
                            staging_bytes=6 * PLANES * PAGE)
    pool = SlotPool.create(64, PLANES * PAGE)
    flat = engine.pin_pool(pool.region)
    rows = flat[:64 * pool.stride_bytes].view(64, pool.stride_bytes)
    engine._pool_on_device = lambda r: r  # type: ignore[method-assign]  # CPU: zero-copy is the rows
    planes, back = planes_of(6), [(torch.zeros_like(p), o, n) for p, o, n in planes_of(6)]
    blocks, slots = [b + b // 3 for b in range(24)], [2 * s for s in range(24)][::-1]
    calls = [(i, i + 2) for i in range(0, PLANES, 2)] if layerwise else [(0, PLANES)]
    saves = [(blocks[:10], slots[:10]), (blocks[10:], slots[10:])]
    for lo, hi in calls:
        if entry == "blocks":
            copy_blocks(engine, planes[lo:hi], rows, saves, into_pool=True)
            copy_blocks(engine, back[lo:hi], rows, [(range(24), slots)], into_pool=False)
            continue
        engine.copy([p for b, s in saves
                     for p in block_pairs(planes[lo:hi], rows, b, s, into_pool=True)])
        engine.copy(block_pairs(back[lo:hi], rows, list(range(24)), slots, into_pool=False))
    engine.record().wait()
    for block, slot in zip(blocks, slots, strict=True):
        assert bytes(pool.view(slot)) == b"".join(bytes(p[block].numpy()) for p, _, _ in planes)
    assert all(torch.equal(m[:24], t[blocks]) for (m, _, _), (t, _, _) in zip(back, planes,
                                                                                strict=True))
    taken = "gather" if strategy == "auto" else strategy
    assert engine.strategy_counts == {s: 2 * len(calls) * (s == taken)
                                      for s in ("runs", "gather", "direct")}
    engine.unpin_pool(flat)
