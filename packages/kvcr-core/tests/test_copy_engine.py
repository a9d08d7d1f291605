"""The copy-engine seam on CPU. Risks: a run of blocks lands in the wrong slot bytes (or a bad
block id copies part of a batch before failing); an asynchronous engine's job reports done
before its copies ran, or hides a failed copy; a pool mapping is unmapped while still
registered for DMA (a re-attach or a close that lets go of the mapping before unpinning it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the copy engines move torch tensors")

from kvcr_core.copyengine import (  # noqa: E402
    CopyFailed,
    CpuCopyEngine,
    PoolBinding,
    block_pairs,
    engine_for,
    runs,
)
from kvcr_core.memory import SlotPool  # noqa: E402
from kvcr_core.testing import ThreadedCopyEngine  # noqa: E402

BLOCKS, PAGE = 12, 512  # two planes of 512 bytes per block: a 1 KiB block in a 4 KiB slot


def kv_planes(seed: int) -> list[tuple[torch.Tensor, int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (BLOCKS, PAGE), generator=gen, dtype=torch.uint8),
             i * PAGE, PAGE) for i in range(2)]


def pool_rows(pool: SlotPool) -> torch.Tensor:
    flat = torch.frombuffer(pool.region.view, dtype=torch.uint8)
    return flat[:pool.capacity_slots * pool.stride_bytes].view(pool.capacity_slots,
                                                                pool.stride_bytes)


@pytest.mark.unit
def test_runs_coalesce_consecutive_blocks_and_slots() -> None:
    """Runs where both block ids and slots advance by one become one copy each."""
    assert list(runs((4, 5, 6, 9, 10), (0, 1, 2, 3, 4))) == [(4, 0, 3), (9, 3, 2)]
    assert list(runs((1, 2), (7, 3))) == [(1, 7, 1), (2, 3, 1)]
    assert list(runs((), ())) == []


@pytest.mark.unit
def test_cpu_engine_round_trips_runs_byte_exactly() -> None:
    """Blocks 2,3,4 and 9 into slots 5,6,7 and 0: each slot holds its block's planes back to
    back; loading them into other blocks gives the same pages."""
    pool = SlotPool.create(8, 2 * PAGE)
    rows, planes, engine = pool_rows(pool), kv_planes(1), CpuCopyEngine()
    blocks, slots = (2, 3, 4, 9), (5, 6, 7, 0)
    pairs = block_pairs(planes, rows, blocks, slots, into_pool=True)
    assert len(pairs) == 2 * 2  # two runs, two planes each
    engine.copy(pairs)
    assert engine.record().done()
    for block, slot in zip(blocks, slots, strict=True):
        want = b"".join(bytes(p[block].numpy()) for p, _, _ in planes)
        assert bytes(pool.view(slot)) == want
    other = kv_planes(2)
    engine.copy(block_pairs(other, rows, (0, 1, 2, 3), slots, into_pool=False))
    for mine, theirs in zip(other, planes, strict=True):
        assert torch.equal(mine[0][0:4], theirs[0][[2, 3, 4, 9]])


@pytest.mark.unit
def test_a_bad_block_or_slot_fails_before_anything_is_copied() -> None:
    """An out-of-range block id or slot raises while planning, so no part of the batch was
    copied (a partial copy could otherwise be published)."""
    pool = SlotPool.create(4, 2 * PAGE)
    rows, planes = pool_rows(pool), kv_planes(3)
    with pytest.raises(ValueError, match="block ids"):
        block_pairs(planes, rows, (1, BLOCKS), (0, 1), into_pool=True)
    with pytest.raises(ValueError, match="slots"):
        block_pairs(planes, rows, (1, 2), (0, pool.capacity_slots), into_pool=True)
    assert bytes(pool.view(0)) == bytes(2 * PAGE)


@pytest.mark.unit
def test_threaded_engine_completes_jobs_only_after_their_copies() -> None:
    """While the helper thread is held, a job is not done and the bytes are not there; once
    released the job completes with the bytes in place."""
    pool = SlotPool.create(4, 2 * PAGE)
    rows, planes, engine = pool_rows(pool), kv_planes(4), ThreadedCopyEngine()
    try:
        engine.hold()
        engine.copy(block_pairs(planes, rows, (0,), (1,), into_pool=True))
        job = engine.record()
        assert not job.done() and bytes(pool.view(1)) == bytes(2 * PAGE)
        engine.release()
        job.wait()
        assert job.done() and bytes(pool.view(1))[:PAGE] == bytes(planes[0][0][0].numpy())
    finally:
        engine.close()


@pytest.mark.unit
def test_threaded_engine_reports_a_failed_copy_through_the_next_job_only() -> None:
    """A copy that fails on the helper thread fails the job recorded after it (done and wait
    raise CopyFailed); later jobs are clean again."""
    pool = SlotPool.create(4, 2 * PAGE)
    rows, planes, engine = pool_rows(pool), kv_planes(5), ThreadedCopyEngine()
    try:
        engine.fail_next_copy()
        engine.copy(block_pairs(planes, rows, (0,), (0,), into_pool=True))
        failed = engine.record()
        with pytest.raises(CopyFailed):
            failed.wait()
        with pytest.raises(CopyFailed):
            failed.done()
        engine.copy(block_pairs(planes, rows, (1,), (1,), into_pool=True))
        engine.record().wait()
        assert bytes(pool.view(0)) == bytes(2 * PAGE) and any(bytes(pool.view(1)))
    finally:
        engine.close()


class Attachment:
    """Stands for an AttachClient: its pool, replaced by a fresh mapping on `reattach`."""

    def __init__(self) -> None:
        self.mapped = SlotPool.create(4, 2 * PAGE)
        self.attach_count = 1

    def pool(self, ns: int = 0) -> SlotPool:
        return self.mapped

    def reattach(self) -> None:
        self.mapped = SlotPool.create(4, 2 * PAGE)  # the old mapping goes once nobody holds it
        self.attach_count += 1

    def close(self) -> None:
        self.mapped.close()


def address(binding: PoolBinding) -> int:
    """Where the binding's rows are (holding no reference to them afterwards)."""
    with binding.use() as rows:
        return int(rows.data_ptr())


@pytest.mark.unit
def test_binding_unpins_a_mapping_before_it_can_be_unmapped() -> None:
    """Pinned once per attach; after a re-attach the old mapping is unpinned (its copies
    waited for) before it is let go, and `release` unpins before the caller's close unmaps."""
    engine, client = ThreadedCopyEngine(), Attachment()
    binding = PoolBinding(engine, client)
    try:
        first = address(binding)
        assert address(binding) == first  # same attachment: no second pin
        client.reattach()
        second = address(binding)
        binding.release()
        client.close()
        assert engine.log == [("pin", first), ("unpin", first), ("unmap", first),
                              ("pin", second), ("unpin", second), ("unmap", second)]
    finally:
        engine.close()


@pytest.mark.unit
def test_binding_counts_a_mapping_that_could_not_be_pinned() -> None:
    """A failed pin leaves usable (pageable) rows and is reported to the caller once."""
    engine, client = ThreadedCopyEngine(), Attachment()
    engine.fail_pin = True
    failed: list[int] = []
    binding = PoolBinding(engine, client, on_pin_failed=lambda: failed.append(1))
    try:
        with binding.use() as rows:
            rows[0, :4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        with binding.use():
            pass
        assert failed == [1] and bytes(client.pool().view(0))[:4] == b"\x01\x02\x03\x04"
        binding.release()
    finally:
        engine.close()


@pytest.mark.unit
def test_cpu_tensors_get_the_inline_engine() -> None:
    """KV on CPU (or any non-CUDA device) copies inline, as before the seam existed."""
    engine = engine_for(torch.device("cpu"))
    assert isinstance(engine, CpuCopyEngine) and not engine.asynchronous


@pytest.mark.integration
def test_importing_the_seam_loads_no_torch() -> None:
    """kvcr-core's torch seam imports torch only when an engine is used."""
    code = ("import sys, kvcr_core.copyengine, kvcr_core.testing\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=120)
    assert out.returncode == 0, out.stderr
