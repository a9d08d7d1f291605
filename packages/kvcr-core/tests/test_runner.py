"""The Runner facade: namespaces, byte-exact store/load, pool budget and metrics."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry

from kvcr_core.config import KVCRConfig, MemoryBacking
from kvcr_core.errors import CapacityError, ClosedError, ConfigError, UnknownNamespaceError
from kvcr_core.keys import NamespaceSpec, sequence_keys
from kvcr_core.memory import HostRegion
from kvcr_core.runner import Runner
from kvcr_core.testing import pattern_block, random_keys, resident_kib
from kvcr_core.types import NamespaceDigest

pytestmark = pytest.mark.unit

BLOCK = 8192
SPEC = NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32", block_size_tokens=16,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/v1")


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def runner(registry: CollectorRegistry) -> Runner:
    r = Runner(KVCRConfig(pool_bytes=64 * BLOCK), registry=registry)
    yield r
    r.close()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_store_then_load_is_byte_exact(runner: Runner) -> None:
    """Blocks stored under token-derived keys come back byte for byte, prefix only."""
    store = runner.open_namespace(SPEC, BLOCK)
    keys = sequence_keys(SPEC, list(range(16 * 6)))
    blocks = [pattern_block(k, BLOCK) for k in keys]
    assert store.store(keys[:4], blocks[:4]) == 4
    assert store.store(keys[:4], blocks[:4]) == 0  # already present: nothing copied
    assert store.lookup(keys) == 4
    assert store.load(keys) == blocks[:4]


def test_namespaces_never_share_blocks(runner: Runner) -> None:
    """Another namespace never sees a block, even under the same key."""
    other = NamespaceSpec(**{**SPEC.__dict__, "tenant": "other"})
    a = runner.open_namespace(SPEC, BLOCK, pool_bytes=16 * BLOCK)
    b = runner.open_namespace(other, BLOCK, pool_bytes=16 * BLOCK)
    keys = random_keys(2)
    a.store(keys, [pattern_block(k, BLOCK) for k in keys])
    assert a.lookup(keys) == 2 and b.lookup(keys) == 0
    assert runner.namespace(SPEC.digest()) is a
    with pytest.raises(UnknownNamespaceError):
        runner.namespace(NamespaceDigest(bytes(16)))


def test_reopen_same_namespace_and_geometry_mismatch(runner: Runner) -> None:
    """Reopening returns the same store; a different block size is refused (incompatible)."""
    store = runner.open_namespace(SPEC, BLOCK)
    assert runner.open_namespace(SPEC, BLOCK) is store
    with pytest.raises(ValueError, match="blocks of 8192 bytes"):
        runner.open_namespace(SPEC, BLOCK * 2)


def test_pool_budget_is_shared_and_bounded(registry: CollectorRegistry) -> None:
    """Namespaces split pool_bytes; when none is left, opening another is a CapacityError."""
    cfg = KVCRConfig(pool_bytes=10 * BLOCK, namespace_pool_bytes=6 * BLOCK,
                     memory_backing=MemoryBacking.ANONYMOUS)
    with Runner(cfg, registry=registry) as runner:
        a = runner.open_namespace(NamespaceDigest(b"a" * 16), BLOCK)
        b = runner.open_namespace(NamespaceDigest(b"b" * 16), BLOCK)
        assert a.pool.capacity_slots == 6 and b.pool.capacity_slots == 4
        with pytest.raises(CapacityError, match="raise pool_bytes"):
            runner.open_namespace(NamespaceDigest(b"c" * 16), BLOCK)
        for digest, slots in ((b"a" * 16, 6), (b"b" * 16, 4)):  # per namespace, bounded labels
            assert sample(registry, "kvcr_pool_capacity_bytes",
                          namespace=digest.hex()[:16]) == slots * BLOCK


def test_metrics_move_with_operations(runner: Runner, registry: CollectorRegistry) -> None:
    """Lookups, hits, stores, loads, evictions, refusals and latencies are all counted."""
    store = runner.open_namespace(SPEC, BLOCK, pool_bytes=2 * BLOCK)
    keys = random_keys(4)
    store.store(keys[:2], [pattern_block(k, BLOCK) for k in keys[:2]])
    store.lookup(keys)
    store.load(keys[:1])
    lease = store.acquire(keys[:2])
    refused = store.reserve(keys[2:])  # both slots leased: refused
    assert refused.refused == 2
    store.release(lease.op)
    store.store(keys[2:3], [pattern_block(keys[2], BLOCK)])  # evicts one
    assert sample(registry, "kvcr_lookups_total") == 1
    assert sample(registry, "kvcr_lookup_hit_blocks_total") == 2
    assert sample(registry, "kvcr_lookup_miss_blocks_total") == 2
    assert sample(registry, "kvcr_blocks_stored_total") == 3
    assert sample(registry, "kvcr_stored_bytes_total") == 3 * BLOCK
    assert sample(registry, "kvcr_blocks_loaded_total") == 3
    assert sample(registry, "kvcr_loaded_bytes_total") == 3 * BLOCK
    ns = SPEC.digest().hex()[:16]
    assert sample(registry, "kvcr_evictions_total", namespace=ns) == 1
    assert sample(registry, "kvcr_capacity_refusals_total", resource="slots") == 2
    assert sample(registry, "kvcr_pool_used_bytes", namespace=ns) == 2 * BLOCK
    assert sample(registry, "kvcr_index_operation_seconds_count", op="reserve") == 3
    assert sample(registry, "kvcr_index_operation_seconds_count", op="lookup") == 1


def test_a_block_changed_between_copy_and_commit_fails_its_check(runner: Runner) -> None:
    """Risk: a process of another uid that maps the pool (a shared tenant) punches or
    rewrites a slot right after the writer copied into it; a checksum taken from the slot
    then vouches for the attacker's bytes (zeros), and every verified load serves them."""
    from kvcr_core.blockcopy import store_blocks
    from kvcr_core.checksums import block_checksum

    store = runner.open_namespace(SPEC, BLOCK)

    class PunchedAfterCopy:
        """The pool, with every slot zeroed right after the writer's copy."""

        def write(self, slot: object, data: bytes) -> None:
            store.pool.write(slot, data)  # type: ignore[arg-type]
            store.pool.view(slot)[:] = bytes(BLOCK)  # type: ignore[arg-type]

        def view(self, slot: object) -> memoryview:
            return store.pool.view(slot)  # type: ignore[arg-type]

    keys = random_keys(2)
    blocks = [pattern_block(k, BLOCK) for k in keys]
    assert store_blocks(store, PunchedAfterCopy(), keys, blocks) == 2  # type: ignore[arg-type]
    lease = store.acquire(keys)
    slots = [s for s in lease.slots if s is not None]
    committed = store.checksums.known(slots)
    assert committed == [block_checksum(b) for b in blocks]  # what was meant to land
    assert all(block_checksum(store.pool.view(s)) != c  # the zeros fail a verified load
               for s, c in zip(slots, committed, strict=True))
    store.release(lease.op)


def test_failed_copy_aborts_the_reservation(runner: Runner) -> None:
    """A copy that raises leaves no READY block and no held slot."""
    store = runner.open_namespace(SPEC, BLOCK)
    keys = random_keys(2)
    with pytest.raises(ValueError, match="slots hold"):
        store.store(keys, [pattern_block(keys[0], BLOCK), b"short"])
    assert store.lookup(keys) == 0 and store.index.used_slots == 0


def test_concurrent_writers_and_readers_stay_consistent(runner: Runner) -> None:
    """Threads storing overlapping keys and reading them never see foreign bytes."""
    store = runner.open_namespace(SPEC, BLOCK, pool_bytes=32 * BLOCK)
    keys = random_keys(48)
    errors: list[str] = []

    def work(seed: int) -> None:
        for i in range(200):
            batch = keys[(seed * 7 + i) % 40:(seed * 7 + i) % 40 + 4]
            store.store(batch, [pattern_block(k, BLOCK) for k in batch])
            lease = store.acquire(batch, prefix_only=False)
            for key, slot in zip(batch, lease.slots, strict=True):
                if slot is not None and bytes(store.view(slot)) != pattern_block(key, BLOCK):
                    errors.append(key.hex())
            store.release(lease.op)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    idx = store.index
    assert idx.used_slots + idx.free_slots == idx.capacity_slots
    assert idx.open_reservations == idx.open_leases == 0


def test_closed_runner_and_bad_policy() -> None:
    """A closed runner refuses use; a bad policy fails at construction with the fix."""
    runner = Runner(KVCRConfig(pool_bytes=4 * BLOCK))
    runner.close()
    with pytest.raises(ClosedError):
        runner.open_namespace(SPEC, BLOCK)
    with pytest.raises(ConfigError, match="eviction_policy"):
        Runner(KVCRConfig(eviction_policy="nope.module:Policy"))


def test_runner_hint_intake_uses_config_limits(registry: CollectorRegistry) -> None:
    """Hints go through the runner's intake: limits from config, outcomes in its metrics."""
    with Runner(KVCRConfig(pool_bytes=4 * BLOCK, max_hint_hashes=2), registry=registry) as r:
        envelope = {"protocol_version": "0.1", "actions": [{
            "action_type": "kv.fetch", "action_version": "1.0",
            "payload": {"source_control_endpoint": "tcp://10.0.0.7:7500",
                        "block_hashes": [1, 2, 3]}}]}
        assert r.hints.accept(envelope) is None
        envelope["actions"][0]["payload"]["block_hashes"] = [1, 2]  # type: ignore[index]
        hint = r.hints.accept(envelope)
        assert hint is not None and hint.all_hashes() == {1, 2}
    assert sample(registry, "kvcr_hints_total", outcome="too_many_hashes") == 1
    assert sample(registry, "kvcr_hints_total", outcome="accepted") == 1


def _resident(region: HostRegion) -> bool:
    """Whether every page of a region's mapping is backed (mincore over the mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * -(-region.size_bytes // mmap.PAGESIZE))()
    assert libc.mincore(ctypes.c_void_p(region.address), ctypes.c_size_t(region.size_bytes),
                        vec) == 0
    return all(v & 1 for v in vec)


def test_the_first_pool_is_backed_before_any_namespace_opens(registry: CollectorRegistry
                                                              ) -> None:
    """Risk (kvcr-guard --prefault): the first namespace's pool is backed while its engine
    attaches (the engine's start waits, the daemon serves no one else); the pre-backed memory
    must be the one the first namespace gets (not a second allocation), a namespace of
    another size must not keep it (the pool budget would be spent twice), and later
    namespaces are made as before."""
    cfg = KVCRConfig(pool_bytes=40 * BLOCK, namespace_pool_bytes=16 * BLOCK)
    with Runner(cfg, registry=registry) as runner:
        assert runner.back_first_pool() == 16 * BLOCK
        backed = runner._backed
        assert backed is not None and _resident(backed)
        first = runner.open_namespace(SPEC, BLOCK)
        assert first.pool.region is backed and first.pool.capacity_slots == 16
        assert runner.back_first_pool() == 0  # a namespace is open: nothing more to back
        other = runner.open_namespace(NamespaceSpec(**{**SPEC.__dict__, "tenant": "b"}), BLOCK)
        assert other.pool.region is not backed and other.pool.capacity_slots == 16
    with Runner(cfg, registry=CollectorRegistry()) as runner:
        runner.back_first_pool()
        backed = runner._backed
        small = runner.open_namespace(SPEC, BLOCK, pool_bytes=4 * BLOCK)
        assert small.pool.region is not backed and small.pool.capacity_slots == 4
        assert backed is not None and backed._map is None  # given back, not kept
        rest = runner.open_namespace(NamespaceSpec(**{**SPEC.__dict__, "tenant": "c"}), BLOCK)
        assert rest.pool.capacity_slots == 16  # the budget was not spent on the backed one


def test_a_back_ahead_pool_backs_each_reservation_before_handing_it_out(
        registry: CollectorRegistry) -> None:
    """Risk (kvcr-guard --back-ahead): the Runner hands out slots whose pages it has not
    backed (the engine that writes them backs them, and its memory cgroup pays), or backs
    the whole pool at once (what back-ahead exists to avoid); the first pool backs only its
    margin before any namespace opens."""
    block, kib = 64 << 10, 1024
    cfg = KVCRConfig(pool_bytes=512 * block, namespace_pool_bytes=256 * block)
    with Runner(cfg, registry=registry) as runner:
        assert runner.back_first_pool(ahead_bytes=8 * block) == 8 * block
        store = runner.open_namespace(SPEC, block)
        region = store.pool.region
        assert resident_kib(region.address, region.size_bytes) == 8 * block // kib
        reservation = store.reserve(random_keys(100, seed=3))
        top = max(s for s in reservation.slots if s is not None) + 1
        assert resident_kib(region.address, top * block) == top * block // kib
        assert resident_kib(region.address, region.size_bytes) < 128 * block // kib
        other = runner.open_namespace(NamespaceSpec(**{**SPEC.__dict__, "tenant": "b"}), block,
                                      back_ahead=4 * block)
        reservation = other.reserve(random_keys(50, seed=4))
        top = max(s for s in reservation.slots if s is not None) + 1
        region = other.pool.region
        assert resident_kib(region.address, top * block) == top * block // kib
        assert resident_kib(region.address, region.size_bytes) < 128 * block // kib
