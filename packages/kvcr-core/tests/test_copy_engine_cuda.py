"""The CUDA copy engine on a real GPU (skipped without one; scripts/gpu_check.sh runs these
with torch alone). Risks: the pool is not really pinned (copies silently pageable and slow);
a run of blocks lands in the wrong bytes through the strided (cudaMemcpy2DAsync) or per-row
path; a copy races the forward: a save reads KV the next kernel already overwrote (no fence),
or a load is overwritten by work queued before it (its stream did not wait); an event reports
done before the bytes are there; a failed registration (or any failed runtime call) leaves its
error pending and the next kernel of the process raises it, instead of slowing copies; a
gathered or zero-copy save or load puts pages in the wrong slots or blocks."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch", reason="the copy engines move torch tensors")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device: torch.cuda.is_available() is False here "
                "(scripts/gpu_check.sh runs these tests on a GPU machine)",
                allow_module_level=True)

from kvcr_core.copyengine import PoolBinding, block_pairs, copy_blocks  # noqa: E402
from kvcr_core.cudacopy import CudaCopyEngine  # noqa: E402
from kvcr_core.cudart import Libcudart  # noqa: E402
from kvcr_core.memory import SlotPool  # noqa: E402

DEVICE = torch.device("cuda")
BLOCKS, PAGE, PLANES = 64, 32 * 1024, 4  # 2 layers x K/V, 32 KiB pages: 128 KiB blocks


def gpu_planes(seed: int) -> list[tuple[torch.Tensor, int, int]]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return [(torch.randint(0, 256, (BLOCKS, PAGE), generator=gen, dtype=torch.uint8,
                           device=DEVICE), i * PAGE, PAGE) for i in range(PLANES)]


def rows_of(pool: SlotPool, flat: torch.Tensor) -> torch.Tensor:
    return flat[:pool.capacity_slots * pool.stride_bytes].view(pool.capacity_slots,
                                                                pool.stride_bytes)


def test_the_pool_mapping_is_pinned_and_unpinned() -> None:
    """cudaHostRegister succeeds on a memfd pool mapping (torch then sees pinned memory), and
    unpin unregisters it."""
    pool, engine = SlotPool.create(16, PLANES * PAGE), CudaCopyEngine(DEVICE)
    flat = engine.pin_pool(pool.region)
    assert engine.pin_failures == 0 and flat.is_pinned()
    engine.unpin_pool(flat)
    assert not flat.is_pinned()


def test_torchs_libcudart_offers_memcpy2d() -> None:
    """Strided runs need cudaMemcpy2DAsync, and clearing a failure cudaGetLastError, from the
    libcudart torch loaded; without it every page is its own copy (correct, launch-bound):
    this says which path this machine gets."""
    engine = CudaCopyEngine(DEVICE)
    assert isinstance(engine.runtime.calls, Libcudart) and engine.memcpy2d


STRATEGIES = [(True, "runs"), (False, "runs"), (True, "gather"), (True, "auto")]


@pytest.mark.parametrize(("memcpy2d", "strategy"), STRATEGIES,
                         ids=["memcpy2d", "per-row", "gather", "auto"])
def test_runs_round_trip_byte_exactly(memcpy2d: bool, strategy: str) -> None:
    """Blocks in runs and singles go to their slots (each plane at its offset) and back into
    other blocks, byte for byte, through either strided path and through a gather whose
    staging halves hold 3 blocks each (chunk edges inside runs, both streams in turn)."""
    pool, engine = SlotPool.create(BLOCKS, PLANES * PAGE), CudaCopyEngine(
        DEVICE, use_memcpy2d=memcpy2d, strategy=strategy, staging_bytes=6 * PLANES * PAGE)
    flat = engine.pin_pool(pool.region)
    rows, planes = rows_of(pool, flat), gpu_planes(1)
    blocks, slots = (3, 4, 5, 6, 20, 40, 41), (10, 11, 12, 13, 0, 30, 31)
    engine.copy(block_pairs(planes, rows, blocks, slots, into_pool=True))
    engine.record().wait()
    for block, slot in zip(blocks, slots, strict=True):
        want = b"".join(p[block].cpu().numpy().tobytes() for p, _, _ in planes)
        assert bytes(pool.view(slot)) == want
    back = gpu_planes(2)
    engine.copy(block_pairs(back, rows, tuple(range(7)), slots, into_pool=False))
    job = engine.record()
    job.wait()
    assert job.done()
    for mine, theirs in zip(back, planes, strict=True):
        assert torch.equal(mine[0][:7], theirs[0][list(blocks)])
    engine.unpin_pool(flat)


def test_a_save_fenced_before_the_next_kernel_reads_what_the_forward_wrote() -> None:
    """The save's copy stream waits for the forward's stream, and `fence` makes the forward's
    later kernels wait for the copy: overwriting the source right after never reaches the
    pool."""
    n = 256  # 256 x 1 MiB: long enough for a race to show
    pool, engine = SlotPool.create(n, 1 << 20), CudaCopyEngine(DEVICE)
    flat = engine.pin_pool(pool.region)
    kv = torch.empty((n, 1 << 20), dtype=torch.uint8, device=DEVICE)
    kv.fill_(7)  # the forward writing KV, on the current stream
    engine.copy(block_pairs([(kv, 0, 1 << 20)], rows_of(pool, flat), tuple(range(n)),
                            tuple(range(n)), into_pool=True))
    job = engine.record()
    engine.fence()
    kv.fill_(9)  # the next step reusing the blocks
    torch.cuda.synchronize()
    job.wait()
    assert bool(rows_of(pool, flat)[:n, :1 << 20].eq(7).all())
    engine.unpin_pool(flat)


def test_a_load_lands_after_work_queued_before_it() -> None:
    """A load's copy waits for the caller's stream: a kernel still writing the blocks (their
    previous owner) cannot overwrite the loaded bytes."""
    n = 256
    pool, engine = SlotPool.create(n, 1 << 20), CudaCopyEngine(DEVICE)
    flat = engine.pin_pool(pool.region)
    rows_of(pool, flat)[:n].fill_(5)
    kv = torch.empty((n, 1 << 20), dtype=torch.uint8, device=DEVICE)
    for _ in range(20):
        kv.fill_(1)  # queued before the load
    engine.copy(block_pairs([(kv, 0, 1 << 20)], rows_of(pool, flat), tuple(range(n)),
                            tuple(range(n)), into_pool=False))
    engine.record().wait()
    torch.cuda.synchronize()
    assert int(kv.min()) == 5 == int(kv.max())
    engine.unpin_pool(flat)


def test_a_mapping_that_cannot_be_pinned_still_copies() -> None:
    """A second registration of the same memory fails: counted, and copies go on pageable."""
    pool = SlotPool.create(8, PLANES * PAGE)
    first, second = CudaCopyEngine(DEVICE), CudaCopyEngine(DEVICE)
    pinned = first.pin_pool(pool.region)
    flat = second.pin_pool(pool.region)
    assert second.pin_failures == 1 and second.cuda_failures == 1
    planes = gpu_planes(3)  # a kernel: raised the pending 712 before it was cleared
    second.copy(block_pairs(planes, rows_of(pool, flat), (1,), (2,), into_pool=True))
    second.record().wait()
    assert bytes(pool.view(2))[:PAGE] == planes[0][0][1].cpu().numpy().tobytes()
    second.unpin_pool(flat)
    first.unpin_pool(pinned)


class Attachment:
    def __init__(self) -> None:
        self.slots = SlotPool.create(8, PLANES * PAGE)
        self.attach_count = 1

    def pool(self, ns: int = 0) -> SlotPool:
        return self.slots


def test_binding_registers_once_per_attach_and_unregisters_on_release() -> None:
    """One registration per attachment; released before the caller unmaps."""
    engine, client = CudaCopyEngine(DEVICE), Attachment()
    binding = PoolBinding(engine, client)
    with binding.use() as rows:
        assert rows.is_pinned()
    with binding.use():
        pass
    client.slots = SlotPool.create(8, PLANES * PAGE)
    client.attach_count += 1
    with binding.use() as rows:
        assert rows.is_pinned()
    binding.release()
    assert engine.pin_failures == 0


def test_a_failed_strided_copy_is_cleared_before_the_next_kernel() -> None:
    """cudaMemcpy2DAsync with a width over its pitch fails (invalid value): the copy raises
    CopyFailed, the error is counted, and the next kernel of the process runs."""
    engine = CudaCopyEngine(DEVICE)
    src = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    dst = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    error = engine.runtime.memcpy2d_async(dst.data_ptr(), 8, src.data_ptr(), 8, 16, 2,
                                          torch.cuda.current_stream().cuda_stream)
    assert error != 0 and engine.cuda_failures == 1
    assert int(torch.ones(4, device=DEVICE).sum()) == 4


def test_gathers_of_several_layerwise_calls_land_byte_exactly() -> None:
    """One layer's two planes of two saves per call, as vLLM's save_kv_layer hands them over
    (pairs for the first layer, whole calls through `copy_blocks` for the second): merged into
    one gather per layer, each slot holds every layer's pages after all calls."""
    pool = SlotPool.create(BLOCKS, PLANES * PAGE)
    engine = CudaCopyEngine(DEVICE, strategy="gather")
    flat = engine.pin_pool(pool.region)
    rows, planes = rows_of(pool, flat), gpu_planes(4)
    saves = [((9, 2, 30), (4, 40, 7)), ((11, 12), (41, 42))]
    pairs = []
    for blocks, slots in saves:
        pairs += block_pairs(planes[:2], rows, blocks, slots, into_pool=True)
    engine.copy(pairs)
    copy_blocks(engine, planes[2:], rows, saves, into_pool=True)
    engine.record().wait()
    assert engine.strategy_counts["gather"] == PLANES // 2
    for blocks, slots in saves:
        for block, slot in zip(blocks, slots, strict=True):
            want = b"".join(p[block].cpu().numpy().tobytes() for p, _, _ in planes)
            assert bytes(pool.view(slot)) == want
    engine.unpin_pool(flat)


def test_zero_copy_round_trip_byte_exactly() -> None:
    """Last (a kernel fault on the mapped pool would end the process's CUDA context): the
    direct strategy writes and reads the registered pool from a kernel, scattered slots, byte
    for byte."""
    pool, engine = SlotPool.create(BLOCKS, PLANES * PAGE), CudaCopyEngine(
        DEVICE, strategy="direct", staging_bytes=6 * PLANES * PAGE)
    flat = engine.pin_pool(pool.region)
    rows, planes = rows_of(pool, flat), gpu_planes(5)
    blocks, slots = (3, 4, 5, 6, 20, 40, 41), (10, 11, 12, 13, 0, 30, 31)
    engine.copy(block_pairs(planes, rows, blocks, slots, into_pool=True))
    engine.record().wait()
    assert engine.strategy_counts["direct"] == 1
    for block, slot in zip(blocks, slots, strict=True):
        want = b"".join(p[block].cpu().numpy().tobytes() for p, _, _ in planes)
        assert bytes(pool.view(slot)) == want
    back = gpu_planes(6)
    engine.copy(block_pairs(back, rows, tuple(range(7)), slots, into_pool=False))
    engine.record().wait()
    for mine, theirs in zip(back, planes, strict=True):
        assert torch.equal(mine[0][:7], theirs[0][list(blocks)])
    engine.unpin_pool(flat)
