"""Host regions and the slot pool: alignment, sharing through memfd, byte-exact slots."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

import pytest

from kvcr_core.errors import ClosedError
from kvcr_core.memory import PAGE_BYTES, SLOT_ALIGN_BYTES, HostRegion, RegionKind, SlotPool
from kvcr_core.testing import mapped_kib, pattern_block, resident_kib
from kvcr_core.types import SlotId


@pytest.mark.unit
@pytest.mark.parametrize("kind", list(RegionKind))
def test_region_rounds_to_pages_and_starts_zeroed(kind: RegionKind) -> None:
    """Regions are whole pages of zeroed memory for both backings."""
    with HostRegion.create(PAGE_BYTES + 1, kind) as region:
        assert region.size_bytes == 2 * PAGE_BYTES
        assert bytes(region.view[:64]) == bytes(64)
        region.prefault()
        assert bytes(region.view[-64:]) == bytes(64)


@pytest.mark.unit
@pytest.mark.parametrize("slot_bytes", [1, 4096, 5000, 65536, 3 * 4096 + 17])
def test_every_slot_start_is_4k_aligned(slot_bytes: int) -> None:
    """Slot starts are 4 KiB-aligned whatever the block size (misaligned copies are 3x slower)."""
    pool = SlotPool.create(5, slot_bytes)
    try:
        assert pool.stride_bytes % SLOT_ALIGN_BYTES == 0
        assert pool.capacity_slots == 5
        assert all(pool.offset(SlotId(i)) % SLOT_ALIGN_BYTES == 0 for i in range(5))
        assert len(pool.view(SlotId(4))) == slot_bytes
    finally:
        pool.close()


@pytest.mark.unit
def test_slots_are_independent_and_byte_exact() -> None:
    """Writing one slot never touches its neighbours; reads return exactly what was written."""
    pool = SlotPool.create(4, 5000, RegionKind.ANONYMOUS)
    try:
        blocks = [pattern_block(bytes([i]) * 16, 5000) for i in range(4)]
        for i, block in enumerate(blocks):
            pool.write(SlotId(i), block)
        out = bytearray(5000)
        for i, block in enumerate(blocks):
            pool.read_into(SlotId(i), out)
            assert bytes(out) == block
        with pytest.raises(ValueError, match="5000"):
            pool.write(SlotId(0), b"short")
        with pytest.raises(IndexError):
            pool.view(SlotId(4))
    finally:
        pool.close()


@pytest.mark.integration
def test_memfd_region_is_shared_with_another_process() -> None:
    """Another process that maps the memfd sees and changes the same bytes (guard mode)."""
    region = HostRegion.create(2 * PAGE_BYTES, RegionKind.MEMFD)
    region.view[:5] = b"hello"
    code = (
        "import sys; from kvcr_core.memory import HostRegion\n"
        "r = HostRegion.map_fd(int(sys.argv[1]), int(sys.argv[2]))\n"
        "assert bytes(r.view[:5]) == b'hello'\n"
        "r.view[8:13] = b'world'\n"
        "r.close()\n"
    )
    subprocess.run([sys.executable, "-c", code, str(region.fd), str(region.size_bytes)],
                   check=True, pass_fds=(region.fd,))
    assert bytes(region.view[8:13]) == b"world"
    region.close()


@pytest.mark.unit
def test_memfd_leaves_nothing_in_dev_shm() -> None:
    """memfd pools create no file in /dev/shm (nothing to leak after a crash)."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    region = HostRegion.create(1 << 20, RegionKind.MEMFD, name="kvcr-leak-check")
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after == before
    assert os.readlink(f"/proc/self/fd/{region.fd}").startswith("/memfd:kvcr-leak-check")
    region.close()


@pytest.mark.unit
def test_closed_region_refuses_use_and_anonymous_has_no_fd() -> None:
    """Using a closed region is the caller's bug and says so; anonymous memory cannot be shared."""
    region = HostRegion.create(PAGE_BYTES, RegionKind.ANONYMOUS)
    with pytest.raises(ValueError, match="MEMFD"):
        _ = region.fd
    region.close()
    with pytest.raises(ClosedError):
        _ = region.view


@pytest.mark.unit
@pytest.mark.parametrize("populate_advice", ["kernel", "unsupported"])
def test_a_second_mapping_of_a_backed_region_maps_every_page_ahead_of_use(
        populate_advice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: an engine's first copy into or out of each pool page pays a fault on the
    request's path though the pool's owner backed it; on a kernel without
    MADV_POPULATE_READ (before 5.14) the mapper must still map the pages (touching them)."""
    if populate_advice == "unsupported":
        monkeypatch.setattr("kvcr_core.memory._MADV_POPULATE_READ", 9999)  # EINVAL
    with HostRegion.create(48 << 20) as owner:
        owner.prefault()
        assert owner.backed
        engine = HostRegion.map_fd(os.dup(owner.fd), owner.size_bytes)
        assert not engine.backed and mapped_kib(engine.address) < 1024
        mapper = engine.map_pages_in_background()
        assert engine.map_pages_in_background() is mapper  # one mapper per region
        mapper.join(timeout=30)
        assert mapped_kib(engine.address) == engine.size_bytes // 1024
        engine.close()


@pytest.mark.unit
def test_closing_a_region_stops_its_page_mapper_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: the background mapper outlives the mapping, so a call in flight during `close`
    touches addresses that are unmapped or someone else's by then; or `close` hangs on it."""
    import time

    engine: HostRegion | None = None
    unmapped_under_a_call: list[bool] = []

    class SlowKernel:
        def mincore(self, address: object, length: object, vector: ctypes.Array) -> int:
            ctypes.memset(vector, 1, ctypes.sizeof(vector))  # every page backed
            return 0

        def madvise(self, *args: object) -> int:
            time.sleep(0.002)  # the GIL is free meanwhile, as in the real call
            assert engine is not None
            unmapped_under_a_call.append(engine._map is None)
            return 0

    monkeypatch.setattr("kvcr_core.memory._libc", SlowKernel)
    monkeypatch.setattr("kvcr_core.memory._MAP_CHUNK_BYTES", 64 << 10)  # many steps to stop at
    with HostRegion.create(16 << 20) as owner:
        owner.prefault()
        for _ in range(4):
            engine = HostRegion.map_fd(os.dup(owner.fd), owner.size_bytes)
            mapper = engine.map_pages_in_background()
            time.sleep(0.01)
            engine.close()
            assert not mapper.is_alive()
            with pytest.raises(ClosedError):
                _ = engine.view
    assert unmapped_under_a_call and not any(unmapped_under_a_call)
    assert len(unmapped_under_a_call) < 4 * 256  # stopped early: 256 chunks a region


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(condition())


@pytest.mark.unit
def test_back_ahead_holds_what_is_used_plus_its_margin_and_keeps_what_writers_wrote() -> None:
    """Risk: a back-ahead pool is backed whole up front (on a VM that hands free memory back
    to its host, every other process's first touches slow down while it is held), or a
    reservation hands out pages not backed yet (the engine that writes them is charged for
    them), or backing a page wipes what a writer already put there, or the backer competes
    with the engines for CPU (measured: +25% p90 TTFT under load at normal priority)."""
    mib = 1 << 20
    with HostRegion.create(128 * mib) as owner:
        size = owner.size_bytes
        with pytest.raises(ValueError, match="positive"):
            owner.back_ahead(0)
        writer = HostRegion.map_fd(os.dup(owner.fd), size)
        block = pattern_block(b"outran", 4096)
        writer.view[100 * mib:100 * mib + 4096] = block  # a writer that outran the backer
        owner.back_ahead(8 * mib, wait=True)
        assert owner.backs_pages and not owner.backed
        backer = owner._backer
        assert backer is not None and backer.native_id is not None
        native_id = backer.native_id
        assert _wait_for(lambda: os.sched_getscheduler(native_id) == os.SCHED_IDLE)
        assert resident_kib(owner.address, 100 * mib) == 8 * 1024  # the margin, no more
        owner.note_used(20 * mib)
        assert resident_kib(owner.address, 20 * mib) == 20 * 1024  # before note_used returned
        assert _wait_for(lambda: resident_kib(owner.address, 100 * mib) >= 28 * 1024)
        time.sleep(0.2)
        assert resident_kib(owner.address, 100 * mib) == 28 * 1024  # used + margin, no more
        owner.note_used(100 * mib + 4096)
        assert _wait_for(lambda: owner.backed_bytes >= 108 * mib)
        assert bytes(owner.view[100 * mib:100 * mib + 4096]) == block
        owner.note_used(size)
        assert owner.backed_bytes == size and resident_kib(owner.address, size) == size // 1024
        writer.close()


@pytest.mark.unit
def test_an_engine_maps_pages_only_as_their_holder_backs_them() -> None:
    """Risk: an engine's page mapper backs the pool's pages itself when its holder backs them
    as the pool fills (the engine's memory cgroup pays for them), or never maps the pages
    backed after it attached (their first copies pay faults on the request's path)."""
    mib = 1 << 20
    with HostRegion.create(128 * mib) as owner:
        owner.back_ahead(16 * mib, wait=True)
        engine = HostRegion.map_fd(os.dup(owner.fd), owner.size_bytes)
        engine.map_pages_in_background()
        assert _wait_for(lambda: mapped_kib(engine.address) >= 16 * 1024)
        time.sleep(0.3)
        assert mapped_kib(engine.address) == 16 * 1024
        assert resident_kib(engine.address, engine.size_bytes) == 16 * 1024
        owner.note_used(40 * mib)
        assert _wait_for(lambda: mapped_kib(engine.address) >= 56 * 1024)
        assert resident_kib(engine.address, engine.size_bytes) == 56 * 1024
        engine.close()
