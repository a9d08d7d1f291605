"""The worker side's ordering rules, as a GPU imposes them, checked on CPU with a copy engine
that completes later on a helper thread (`ThreadedCopyEngine`) against a real kvcr-guard.
Risks: a save committed (READY for every reader) before its bytes landed; a load reported
finished (vLLM runs the request) before its bytes landed; a failed copy published or loaded;
layer-wise saves that do not copy a layer when the forward hands it over; the pool mapping
unmapped while still registered for DMA (re-attach, shutdown)."""

from __future__ import annotations

import threading

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True, params=[0, 2], ids=["hash-in-line", "hash-threads"])
def hash_threads(request, monkeypatch):  # type: ignore[no-untyped-def]
    """Every test runs with saves hashed in line and on two sealer threads (kvcr_core.sealing:
    the commit then comes from a sealer thread, after the worker's hook returned)."""
    monkeypatch.setenv("KVCR_HASH_THREADS", str(request.param))
    return request.param

torch = pytest.importorskip("torch", reason="torch comes with vLLM (scripts/setup.sh)")
pytest.importorskip("vllm", reason="the worker imports vLLM's metadata base classes")

from kvcr_core import Lease  # noqa: E402
from kvcr_core.attach import AttachClient  # noqa: E402
from kvcr_core.checksums import block_checksum  # noqa: E402
from kvcr_core.keys import NamespaceSpec, sequence_keys  # noqa: E402
from kvcr_core.testing import ThreadedCopyEngine  # noqa: E402
from kvcr_vllm.metadata import KVCRConnectorMetadata, LoadPlan, SavePlan  # noqa: E402
from kvcr_vllm.settings import ConnectorSettings  # noqa: E402
from kvcr_vllm.stats import StatsRecorder  # noqa: E402
from kvcr_vllm.worker import KVCRConnectorWorker  # noqa: E402

NUM_BLOCKS, HEADS, BLOCK, HEAD2 = 16, 2, 32, 128  # CPU layout [blocks, heads, tokens, 2*hd]
SPEC = NamespaceSpec(model_id="ordering", dtype="float32", kv_dtype="float32",
                     block_size_tokens=BLOCK, num_layers=2, num_kv_heads=HEADS, head_dim=64,
                     layout="test/cpu")
PAGE = HEADS * BLOCK * HEAD2 * 4
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
GUARD_ARGS = ("--pool-bytes", "512MiB", "--namespace-pool-bytes", "256MiB")


@pytest.fixture
def engine():  # type: ignore[no-untyped-def]
    e = ThreadedCopyEngine()
    yield e
    e.close()


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn(2, NUM_BLOCKS, HEADS, BLOCK, HEAD2, generator=gen)
    return {name: storage[i] for i, name in enumerate(LAYERS)}


def block_bytes(caches: dict[str, torch.Tensor], block: int) -> bytes:
    return b"".join(caches[name][block].numpy().tobytes() for name in LAYERS)


def make_worker(socket: str, engine: ThreadedCopyEngine | None,
                stats: StatsRecorder | None = None) -> KVCRConnectorWorker:
    settings = ConnectorSettings.from_extra_config({"mode": "guarded", "socket": socket}, "e")
    return KVCRConnectorWorker(settings, SPEC, 0, 2 * PAGE, NUM_BLOCKS, stats or StatsRecorder(),
                               "engine", copy_engine=engine)


def step(worker: KVCRConnectorWorker, metadata: KVCRConnectorMetadata) -> None:
    """One vLLM step's hooks: bind, the forward's layer-by-layer saves, wait_for_save."""
    worker.bind(metadata)
    for name in LAYERS:
        worker.save_kv_layer(metadata, name)
    worker.wait_for_save(metadata)


def saves(req: str, blocks: tuple[int, ...], first_token: int) -> KVCRConnectorMetadata:
    keys = sequence_keys(SPEC, list(range(first_token, first_token + len(blocks) * BLOCK)))
    return KVCRConnectorMetadata(saves=[SavePlan(req, blocks, (tuple(keys),))])


def published(worker: KVCRConnectorWorker, reader: AttachClient,
              metadata: KVCRConnectorMetadata) -> int:
    """Polls the worker (vLLM's next hook), lets its sealer commit what the poll handed it
    and the commits reach the guard, looks up."""
    worker.get_finished(set())
    assert worker.sealer.flush(10)
    worker.client.flush()
    return reader.lookup(metadata.saves[0].keys_by_rank[0])  # type: ignore[arg-type]


def test_a_save_is_committed_only_after_its_copies_completed(guard, engine,
                                                            hash_threads) -> None:
    """While the copies are in flight the blocks stay FILLING, however often the worker is
    polled; once they complete the commit arrives, with the checksums of the bytes copied
    (hashed by the sealer's threads where it has any: never on vLLM's worker thread)."""
    caches = kv_caches(1)
    worker = make_worker(guard.socket, engine)
    worker.register_kv_caches(caches)
    reader = AttachClient(guard.socket, SPEC, 2 * PAGE)
    metadata = saves("r", (2, 3), 0)
    engine.hold()
    step(worker, metadata)
    assert published(worker, reader, metadata) == 0
    assert published(worker, reader, metadata) == 0 and reader.stats().filling_blocks == 2
    engine.release()
    engine.drain()
    assert published(worker, reader, metadata) == 2
    lease = reader.acquire(metadata.saves[0].keys_by_rank[0],  # type: ignore[arg-type]
                           checksums=True)
    want = [block_bytes(caches, b) for b in (2, 3)]
    assert [bytes(reader.pool().view(s)) for s in lease.slots if s is not None] == want
    assert list(lease.checksums) == [block_checksum(w) for w in want]
    hashed = (worker.sealer.sealed_blocks, worker.sealer.inline_blocks)
    assert hashed == ((2, 0) if hash_threads else (0, 2))
    reader.release(lease.op)
    reader.close()
    worker.shutdown()


def test_layer_wise_saves_copy_each_layer_when_the_forward_hands_it_over(guard, engine) -> None:
    """A layer is copied at its save_kv_layer (bytes written to it later are not in the
    pool), the rest in wait_for_save, which fences vLLM's stream once; a layer handed over
    twice in a step (a second forward) makes wait_for_save copy every layer again."""
    caches = kv_caches(2)
    worker = make_worker(guard.socket, engine)
    worker.register_kv_caches(caches)
    reader = AttachClient(guard.socket, SPEC, 2 * PAGE)
    first = saves("a", (5,), 0)
    before = caches[LAYERS[0]][5].clone()
    worker.bind(first)
    worker.save_kv_layer(first, LAYERS[0])
    engine.drain()
    caches[LAYERS[0]][5] += 1.0  # after layer 0 was handed over: not this step's KV
    worker.wait_for_save(first)  # copies layer 1, which save_kv_layer did not hand over
    engine.drain()
    assert published(worker, reader, first) == 1 and engine.fences == 1
    lease = reader.acquire(first.saves[0].keys_by_rank[0])  # type: ignore[arg-type]
    saved = bytes(reader.pool().view(lease.slots[0]))
    assert saved[:PAGE] == before.numpy().tobytes()
    assert saved[PAGE:] == caches[LAYERS[1]][5].numpy().tobytes()
    reader.release(lease.op)
    again = saves("b", (6,), 1000)
    worker.bind(again)
    worker.save_kv_layer(again, LAYERS[0])
    engine.drain()
    caches[LAYERS[0]][6] += 1.0  # a second forward rewrote layer 0 ...
    worker.save_kv_layer(again, LAYERS[0])  # ... and handed it over again
    worker.wait_for_save(again)
    engine.drain()
    assert published(worker, reader, again) == 1
    lease = reader.acquire(again.saves[0].keys_by_rank[0])  # type: ignore[arg-type]
    assert bytes(reader.pool().view(lease.slots[0])) == block_bytes(caches, 6)
    reader.release(lease.op)
    reader.close()
    worker.shutdown()


def saved_blocks(socket: str, seed: int, blocks: tuple[int, ...], first_token: int
                 ) -> tuple[dict[str, torch.Tensor], AttachClient, Lease, tuple[int, ...]]:
    """`blocks` of fresh KV caches saved by an inline worker, then leased by a reader:
    (the caches, the reader, its lease, the leased slots)."""
    caches = kv_caches(seed)
    saver = make_worker(socket, None)  # inline CPU copies
    saver.register_kv_caches(caches)
    metadata = saves("w", blocks, first_token)
    saver.wait_for_save(metadata)
    saver.shutdown()
    reader = AttachClient(socket, SPEC, 2 * PAGE)
    lease = reader.acquire(metadata.saves[0].keys_by_rank[0])  # type: ignore[arg-type]
    return caches, reader, lease, tuple(s for s in lease.slots if s is not None)


def test_a_load_is_reported_finished_only_after_its_copies_completed(guard, engine) -> None:
    """get_finished leaves the request out (vLLM keeps it waiting) until its copies landed."""
    caches, reader, lease, slots = saved_blocks(guard.socket, 3, (1, 2, 3), 0)
    loader_caches = kv_caches(4)
    loader = make_worker(guard.socket, engine)
    loader.register_kv_caches(loader_caches)
    engine.hold()
    loader.start_load_kv(KVCRConnectorMetadata(loads=[LoadPlan("r", (8, 9, 10), (slots,))]))
    assert loader.get_finished(set()) == (None, None)
    assert loader.get_finished(set()) == (None, None)  # however often it is asked
    engine.release()
    engine.drain()
    assert loader.get_finished(set()) == (None, {"r"})
    assert loader.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(loader_caches[name][8:11], caches[name][1:4])
    reader.release(lease.op)
    reader.close()
    loader.shutdown()


def test_a_synchronous_load_is_complete_before_the_forward_pass(guard, engine) -> None:
    """Risk: start_load_kv returning (and vLLM running the forward pass that reads the blocks)
    before a synchronous load's copies landed, or the load reported where vLLM does not look
    for a synchronous one (get_finished) instead of with the step's output (its report)."""
    caches, reader, lease, slots = saved_blocks(guard.socket, 5, (1, 2), 100)
    loader_caches = kv_caches(6)
    loader = make_worker(guard.socket, engine)
    loader.register_kv_caches(loader_caches)
    engine.hold()
    plan = LoadPlan("r", (5, 6), (slots,), synchronous=True)
    started = threading.Thread(target=loader.start_load_kv,
                               args=(KVCRConnectorMetadata(loads=[plan]),))
    started.start()
    started.join(timeout=0.3)
    assert started.is_alive()  # still waiting for its copies: the forward cannot start
    engine.release()
    started.join(timeout=10)
    assert not started.is_alive()
    for name in LAYERS:
        assert torch.equal(loader_caches[name][5:7], caches[name][1:3])
    assert loader.get_finished(set()) == (None, None)
    done = loader.report()
    assert done is not None and done.loads_done == {"r"}
    reader.release(lease.op)
    reader.close()
    loader.shutdown()


def test_a_failed_copy_aborts_the_save_and_fails_the_load(guard, engine) -> None:
    """A copy that fails after it was issued: the save's reservation is aborted (nothing
    READY, nothing left FILLING) and counted; the load's blocks are load errors (recomputed)
    and the request is still reported, so vLLM does not wait for it forever."""
    stats = StatsRecorder()
    worker = make_worker(guard.socket, engine, stats)
    worker.register_kv_caches(kv_caches(5))
    reader = AttachClient(guard.socket, SPEC, 2 * PAGE)
    metadata = saves("r", (4, 5), 0)
    engine.fail_next_copy()
    step(worker, metadata)
    engine.drain()
    assert published(worker, reader, metadata) == 0 and reader.stats().filling_blocks == 0
    assert stats.take().data["failures"] == {"save_copy": 1}  # type: ignore[union-attr]
    step(worker, metadata)  # the same blocks save cleanly afterwards
    engine.drain()
    assert published(worker, reader, metadata) == 2
    lease = reader.acquire(metadata.saves[0].keys_by_rank[0])  # type: ignore[arg-type]
    engine.fail_next_copy()
    worker.start_load_kv(KVCRConnectorMetadata(loads=[LoadPlan(
        "l", (11, 12), (tuple(s for s in lease.slots if s is not None),))]))
    engine.drain()
    assert worker.get_finished(set()) == (None, {"l"})
    assert worker.get_block_ids_with_load_errors() == {11, 12}
    assert stats.take().data["failures"] == {"load_copy": 1}  # type: ignore[union-attr]
    reader.release(lease.op)
    reader.close()
    worker.shutdown()


def test_the_pool_is_unpinned_before_it_is_unmapped(short_tmp, harness, engine) -> None:
    """kvcr-guard restarts: the worker re-attaches to the new pool, unpinning the old mapping
    (after its copies) before letting it go, and tells the scheduler its earlier saves are
    suspect (they went with the old daemon); at shutdown it unpins before detaching."""
    guard = harness.Guard(short_tmp, *GUARD_ARGS).start()
    stats = StatsRecorder()
    worker = make_worker(guard.socket, engine, stats)
    worker.register_kv_caches(kv_caches(6))
    step(worker, saves("a", (1,), 0))
    engine.drain()
    worker.get_finished(set())
    assert worker.sealer.flush(10)
    first = worker.report()
    assert first is not None and len(first.saved_keys) == 1 and not first.suspect
    guard.stop()
    restarted = harness.Guard(short_tmp, *GUARD_ARGS).start()
    step(worker, saves("b", (2,), 100))  # the old connection is dead: this save is lost
    worker.client.attach()  # re-attach now (not after the back-off a step would wait for)
    reader = AttachClient(restarted.socket, SPEC, 2 * PAGE)
    third = saves("c", (3,), 200)
    step(worker, third)
    engine.drain()
    assert published(worker, reader, third) == 1
    again = worker.report()  # what was reported saved before went with the old daemon
    assert again is not None and again.suspect
    worker.shutdown()
    assert [event for event, _ in engine.log] == ["pin", "unpin", "unmap",
                                                  "pin", "unpin", "unmap"]
    assert stats.take().data["failures"]["guard_unavailable"] >= 1  # type: ignore[union-attr]
    reader.close()
