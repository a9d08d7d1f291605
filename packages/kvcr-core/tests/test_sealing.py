"""The sealer (kvcr_core.sealing): saved blocks are hashed off the writer's thread and
committed only once hashed, with the right checksum in the right order; its queue is bounded
(an overflowing seal is hashed in line, never dropped or waited for); a failing commit is
counted and does not stop it. Unit layer: a real Runner namespace, no process, no socket."""

from __future__ import annotations

import threading

import pytest

from kvcr_core.checksums import block_checksum, block_checksum_nogil
from kvcr_core.config import KVCRConfig, MemoryBacking
from kvcr_core.runner import Runner
from kvcr_core.sealing import PART_BYTES, Sealer, hash_thread_count, hot_in_line_default
from kvcr_core.testing import random_keys
from kvcr_core.types import NamespaceDigest

pytestmark = pytest.mark.unit
BLOCK = 64 * 1024


@pytest.fixture
def store():
    with Runner(KVCRConfig(pool_bytes=256 * BLOCK,
                           memory_backing=MemoryBacking.ANONYMOUS)) as runner:
        yield runner.open_namespace(NamespaceDigest(bytes(16)), BLOCK)


def _write(store, keys, seed=1):
    """Reserves `keys` and fills each slot with distinct bytes; returns (op, views)."""
    res = store.reserve(keys)
    views = []
    for i, slot in enumerate(res.slots):
        store.pool.write(slot, bytes([(seed + i) % 256]) * BLOCK)
        views.append(store.pool.view(slot))
    return res.op, views


def _commit(store, op):
    return lambda sums: store.commit(op, checksums=sums)


def test_the_nogil_checksum_is_the_one_peers_verify() -> None:
    """Risk: the threads' hash (the streaming form) differs from the one-shot form, and every
    sealed block fails every peer's and every verify_loads check."""
    data = bytes(range(256)) * 1024 + b"tail"
    assert block_checksum_nogil(data) == block_checksum(data)
    assert block_checksum_nogil(memoryview(data)[:4096]) == block_checksum(data[:4096])


def test_a_sealed_block_is_ready_only_once_hashed_and_carries_its_checksum(store) -> None:
    """Risk: a block is published before its hash exists (served to a peer or verified
    against nothing), or with another block's checksum."""
    keys = random_keys(8, seed=3)
    op, views = _write(store, keys)
    gate = threading.Event()

    def held(sums):
        gate.wait(10)
        store.commit(op, checksums=sums)

    sealer = Sealer(2)
    sealer.seal(views, held)
    assert store.lookup(keys) == 0  # hashed or not, nothing is READY before the commit
    assert not sealer.flush(0.05)
    gate.set()
    assert sealer.flush(10)
    assert store.lookup(keys) == 8
    lease = store.acquire(keys)
    assert [store.checksums.of(s) for s in lease.slots] == \
        [block_checksum(bytes([(1 + i) % 256]) * BLOCK) for i in range(8)]
    store.release(lease.op)
    assert sealer.sealed_blocks == 8 and sealer.inline_blocks == 0
    sealer.close()


def test_a_large_seal_is_split_across_threads_and_keeps_its_order(store) -> None:
    """Risk: the parts of one seal, hashed by several threads, come back out of order."""
    n = 2 * PART_BYTES // BLOCK + 3
    region_keys = random_keys(n, seed=5)
    with Runner(KVCRConfig(pool_bytes=(n + 8) * BLOCK,
                           memory_backing=MemoryBacking.ANONYMOUS)) as runner:
        big = runner.open_namespace(NamespaceDigest(bytes(16)), BLOCK)
        op, views = _write(big, region_keys)
        got: list[list[int]] = []
        sealer = Sealer(3)
        sealer.seal(views, got.append)
        assert sealer.flush(30)
        assert got == [[block_checksum(v) for v in views]]
        big.abort(op)
        sealer.close()
        for view in views:  # the sealer holds none of them any more: the pool can close
            view.release()


def test_a_full_queue_hashes_in_line_and_loses_nothing(store) -> None:
    """Risk: a writer that outruns the threads blocks the engine's step, or its blocks are
    dropped; the bound is what keeps memory and delay finite."""
    gate = threading.Event()
    published: list[str] = []
    sealer = Sealer(1, max_pending_bytes=4 * BLOCK)
    first_op, first = _write(store, random_keys(4, seed=7))
    second_op, second = _write(store, random_keys(4, seed=8), seed=50)

    def slow(sums):
        gate.wait(10)
        published.append("first")
        store.commit(first_op, checksums=sums)

    sealer.seal(first, slow)  # fills the queue; its thread waits at the gate
    sealer.seal(second, lambda sums: (published.append("second"),
                                      store.commit(second_op, checksums=sums)))
    assert published == ["second"]  # hashed and committed in line, at once
    assert sealer.inline_blocks == 4
    gate.set()
    assert sealer.flush(10)
    assert published == ["second", "first"]
    assert store.index.ready_blocks == 8
    sealer.close()


def test_a_failing_commit_is_counted_and_the_sealer_goes_on(store) -> None:
    """Risk: one commit that raises (its connection gone) kills the hashing thread and every
    later save waits forever."""
    sealer = Sealer(1)

    def broken(sums):
        raise ConnectionError("the Runner went away")

    _, views = _write(store, random_keys(2, seed=9))
    sealer.seal(views, broken)
    op, views2 = _write(store, random_keys(2, seed=10), seed=90)
    sealer.seal(views2, _commit(store, op))
    assert sealer.flush(10)
    assert sealer.publish_failures == 1
    assert store.index.ready_blocks == 2
    sealer.close()


def test_without_threads_a_batch_hashes_each_block_as_it_is_added(store) -> None:
    """Risk: in line mode hashes a whole batch after its copies (out of the cache: measured
    0.56 of a copy instead of 0.77), or commits something other than what was copied."""
    sealer = Sealer(0)
    keys = random_keys(3, seed=11)
    res = store.reserve(keys)
    seal = sealer.batch()
    for i, slot in enumerate(res.slots):
        store.pool.write(slot, bytes([i]) * BLOCK)
        seal.add(store.pool.view(slot))
        assert sealer.inline_blocks == i + 1  # hashed now, not at publish
    store.pool.write(res.slots[0], bytes([7]) * BLOCK)  # changed after its hash
    seal.publish(_commit(store, res.op))
    assert store.lookup(keys) == 3
    assert store.checksums.of(res.slots[0]) == block_checksum(bytes([0]) * BLOCK)


def test_with_threads_a_batch_is_hashed_off_the_writers_thread(store) -> None:
    """Risk: a big host's writer hashes in its own thread after all (its step pays)."""
    sealer = Sealer(1, hot_in_line=False)
    keys = random_keys(3, seed=13)
    res = store.reserve(keys)
    seal = sealer.batch()
    for i, slot in enumerate(res.slots):
        seal.write(store.pool.view(slot), bytes([i + 1]) * BLOCK)
    assert sealer.inline_blocks == 0 and store.lookup(keys) == 0
    seal.publish(_commit(store, res.op))
    assert sealer.flush(10) and store.lookup(keys) == 3
    assert sealer.sealed_blocks == 3 and sealer.inline_blocks == 0
    assert store.checksums.of(res.slots[2]) == block_checksum(bytes([3]) * BLOCK)
    sealer.close()


def test_a_closed_sealer_hashes_in_line(store) -> None:
    """Risk: a seal made during shutdown is queued to stopped threads and never committed."""
    sealer = Sealer(2)
    sealer.close()
    op, views = _write(store, random_keys(2, seed=12))
    sealer.seal(views, _commit(store, op))
    assert store.index.ready_blocks == 2 and sealer.inline_blocks == 2


@pytest.mark.parametrize(("setting", "cpus", "threads"), [
    ("auto", 1, 1), ("auto", 2, 1), ("auto", 7, 1), ("auto", 8, 2), ("auto", 16, 4),
    ("auto", 192, 4), (0, 16, 0), (6, 2, 6)])
def test_auto_gives_every_host_a_thread_and_big_ones_four(setting, cpus, threads) -> None:
    """Risk: a vLLM worker hashes its step's saves in line, out of the cache (0.63 of the
    unhashed saves on 2 vCPUs, 0.92 with a thread), or a large host hashes on one core at a
    tenth of the link."""
    assert hash_thread_count(setting, cpus) == threads


@pytest.mark.parametrize(("cpus", "hot"), [(1, True), (2, True), (3, True), (4, False),
                                           (64, False)])
def test_block_by_block_writers_hash_in_the_cache_on_small_hosts(cpus, hot) -> None:
    """Risk: on a 2-core host a block-by-block writer (SGLang's HiCache writes) hands each
    block to a thread that competes with its next copy (0.59-0.74 of a copy, 0.78 in line)."""
    assert hot_in_line_default(cpus) is hot
    assert Sealer(0, hot_in_line=False).hot_in_line  # no threads: always in line
    assert not Sealer(2, hot_in_line=False).hot_in_line
