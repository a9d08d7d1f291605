"""The worker side's copies with real torch KV tensors and a real kvcr-guard daemon: bytes
land exactly, a load that cannot complete is reported for recompute, a save that cannot
complete publishes nothing."""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from typing import Any

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

from kvcr_core.attach import AttachClient  # noqa: E402
from kvcr_core.copyengine import CpuCopyEngine  # noqa: E402
from kvcr_core.keys import NamespaceSpec, sequence_keys  # noqa: E402
from kvcr_vllm.metadata import KVCRConnectorMetadata, LoadPlan, SavePlan  # noqa: E402
from kvcr_vllm.settings import ConnectorSettings  # noqa: E402
from kvcr_vllm.stats import StatsRecorder  # noqa: E402
from kvcr_vllm.worker import KVCRConnectorWorker  # noqa: E402

NUM_BLOCKS, HEADS, BLOCK, HEAD2 = 16, 2, 32, 128  # CPU layout [blocks, heads, tokens, 2*hd]
SPEC = NamespaceSpec(model_id="unit", dtype="float32", kv_dtype="float32",
                     block_size_tokens=BLOCK, num_layers=2, num_kv_heads=HEADS, head_dim=64,
                     layout="test/cpu")
PAGE = HEADS * BLOCK * HEAD2 * 4


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn(2, NUM_BLOCKS, HEADS, BLOCK, HEAD2, generator=gen)
    return {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(2)}


def make_worker(socket: str, stats: StatsRecorder, **kwargs: Any) -> KVCRConnectorWorker:
    settings = ConnectorSettings.from_extra_config({"mode": "guarded", "socket": socket}, "e")
    return KVCRConnectorWorker(settings, SPEC, 0, 2 * PAGE, NUM_BLOCKS, stats, "engine",
                               **kwargs)


class SlowCopies(CpuCopyEngine):
    """Inline copies that take at least 50 ms a batch."""

    def copy(self, pairs: Sequence[Any]) -> None:
        time.sleep(0.05)
        super().copy(pairs)


def test_a_synchronous_loads_time_includes_its_copy(guard) -> None:
    """Risk: `vllm:kvcr_load_seconds` measured from after an inline (CPU) copy to its
    report, so dashboards showed loads of microseconds whatever they cost."""
    keys = sequence_keys(SPEC, list(range(2 * BLOCK)))
    a = make_worker(guard.socket, StatsRecorder())
    a.register_kv_caches(kv_caches(1))
    a.wait_for_save(KVCRConnectorMetadata(saves=[SavePlan("r1", (3, 4), (tuple(keys),))]))
    a.shutdown()
    reader = AttachClient(guard.socket, SPEC, 2 * PAGE)
    lease = reader.acquire(keys)
    stats = StatsRecorder()
    b = make_worker(guard.socket, stats, copy_engine=SlowCopies())
    b.register_kv_caches(kv_caches(2))
    b.start_load_kv(KVCRConnectorMetadata(loads=[LoadPlan(
        "r2", (9, 10), (tuple(s for s in lease.slots if s is not None),), synchronous=True)]))
    assert b.report() is not None
    taken = stats.take()
    assert taken is not None
    (seconds,) = taken.data["load_seconds"]
    assert seconds >= 0.05  # the copy's time is the load's
    reader.release(lease.op)
    reader.close()
    b.shutdown()


@pytest.mark.parametrize("synchronous", [False, True])
def test_save_then_load_moves_exact_pages_between_engines(guard, synchronous: bool) -> None:
    """Engine A's blocks 3..6 saved and reported saved (the scheduler announces them from the
    report); engine B loads them into blocks 9..12 byte-exactly and reports the load done
    where vLLM looks for it (risk: a synchronous load reported as an asynchronous one trips
    vLLM's scheduler, its lease is never released, or a save goes unreported)."""
    keys = sequence_keys(SPEC, list(range(4 * BLOCK)))
    a_caches, b_caches = kv_caches(1), kv_caches(2)
    a, b = make_worker(guard.socket, StatsRecorder()), make_worker(guard.socket, StatsRecorder())
    a.register_kv_caches(a_caches)
    b.register_kv_caches(b_caches)
    a.wait_for_save(KVCRConnectorMetadata(saves=[SavePlan("r1", (3, 4, 5, 6), (tuple(keys),))]))
    assert a.sealer.flush(10)  # with hashing threads the commit follows the hook
    saved = a.report()
    assert saved is not None and saved.saved_keys == set(keys) and not saved.suspect
    assert a.report() is None  # reported once
    a.shutdown()
    reader = AttachClient(guard.socket, SPEC, 2 * PAGE)
    lease = reader.acquire(keys)
    assert lease.granted == 4
    reader.release(lease.op)
    b.start_load_kv(KVCRConnectorMetadata(loads=[LoadPlan(
        "r2", (9, 10, 11, 12), (tuple(s for s in lease.slots if s is not None),),
        synchronous=synchronous)]))
    done = b.report()
    if synchronous:
        assert b.get_finished(set()) == (None, None) and done is not None
        assert done.loads_done == {"r2"} and not done.saved_keys and b.report() is None
    else:
        assert b.get_finished(set()) == (None, {"r2"}) and done is None
    assert b.get_block_ids_with_load_errors() == set()
    for layer in a_caches:
        assert torch.equal(b_caches[layer][9:13], a_caches[layer][3:7])
    reader.close()
    b.shutdown()


def test_unleased_and_unreachable_loads_are_reported_for_recompute(short_tmp, harness) -> None:
    """Blocks the scheduler could not lease, and every block when the daemon is gone, are
    load errors (vLLM recomputes them); the request is still reported as received."""
    guard = harness.Guard(short_tmp, "--pool-bytes", "64MiB", "--namespace-pool-bytes",
                          "32MiB").start()
    stats = StatsRecorder()
    worker = make_worker(guard.socket, stats)
    worker.register_kv_caches(kv_caches(3))
    worker.start_load_kv(KVCRConnectorMetadata(loads=[LoadPlan("r", (), (), (4, 5))]))
    assert worker.get_block_ids_with_load_errors() == {4, 5}
    guard.stop(signal.SIGKILL)
    worker.start_load_kv(KVCRConnectorMetadata(loads=[LoadPlan("s", (1, 2), ((0, 1),))]))
    assert worker.get_finished(set())[1] == {"r", "s"}
    assert worker.get_block_ids_with_load_errors() == {1, 2}
    assert stats.take().data["failures"]["guard_unavailable"] >= 1  # type: ignore[union-attr]
    worker.shutdown()
    guard.log.close()


def test_failed_save_publishes_nothing(guard) -> None:
    """A save whose copy fails is aborted: its keys never become READY."""
    keys = sequence_keys(SPEC, list(range(2 * BLOCK)))
    stats = StatsRecorder()
    worker = make_worker(guard.socket, stats)
    worker.register_kv_caches(kv_caches(4))
    bad = SavePlan("r", (1, NUM_BLOCKS + 5), (tuple(keys),))  # second block id out of range
    worker.wait_for_save(KVCRConnectorMetadata(saves=[bad]))
    worker.shutdown()
    reader = AttachClient(guard.socket, SPEC, 2 * PAGE)
    assert reader.lookup(keys) == 0 and reader.stats().filling_blocks == 0
    assert stats.take().data["failures"]["save_copy"] == 1  # type: ignore[union-attr]
    reader.close()


def test_a_bad_save_fails_alone_in_a_step_copied_as_one_call(guard) -> None:
    """Risk: a step's saves, now copied as one engine call, all fail (or all publish) because
    one request's blocks are out of range."""
    good_keys = sequence_keys(SPEC, list(range(2 * BLOCK)))
    bad_keys = sequence_keys(SPEC, list(range(1000, 1000 + 2 * BLOCK)))
    stats = StatsRecorder()
    worker = make_worker(guard.socket, stats)
    worker.register_kv_caches(kv_caches(4))
    worker.wait_for_save(KVCRConnectorMetadata(saves=[
        SavePlan("good", (2, 3), (tuple(good_keys),)),
        SavePlan("bad", (4, NUM_BLOCKS + 1), (tuple(bad_keys),))]))
    worker.shutdown()
    reader = AttachClient(guard.socket, SPEC, 2 * PAGE)
    assert reader.lookup(good_keys) == 2 and reader.lookup(bad_keys) == 0
    assert reader.stats().filling_blocks == 0
    assert stats.take().data["failures"] == {"save_copy": 1}  # type: ignore[union-attr]
    reader.close()


class FailingCudaCalls(CpuCopyEngine):
    """A copy engine whose runtime calls failed (and were cleared) `cuda_failures` times."""

    cuda_failures = 0


def test_failed_cuda_calls_reach_the_failure_metric(guard) -> None:
    """Risk: a CUDA runtime call that failed (cleared so the engine keeps running) is only in
    a log line an operator never sees: it must count in vllm:kvcr_failures_total."""
    stats = StatsRecorder()
    engine = FailingCudaCalls()
    worker = make_worker(guard.socket, stats, copy_engine=engine)
    worker.register_kv_caches(kv_caches(4))
    engine.cuda_failures = 2
    worker.get_finished(set())
    worker.get_finished(set())  # counted once
    engine.cuda_failures = 3
    worker.get_finished(set())
    assert stats.take().data["failures"] == {"cuda_call": 3}  # type: ignore[union-attr]
    worker.shutdown()


def test_unexpected_layouts_disable_kvcr_instead_of_copying_garbage(guard) -> None:
    """KV tensors without a block axis, or pages that do not add up, disable the worker."""
    stats = StatsRecorder()
    worker = make_worker(guard.socket, stats)
    worker.register_kv_caches({"l0": torch.zeros(3, 7)})
    worker.start_load_kv(KVCRConnectorMetadata(loads=[LoadPlan("r", (1,), ((0,),))]))
    assert worker.get_block_ids_with_load_errors() == {1}
    assert stats.take().data["failures"]["config"] == 1  # type: ignore[union-attr]
    worker.shutdown()


def test_verified_loads_recompute_blocks_changed_in_the_pool_since_their_commit(guard) -> None:
    """Risk: a block scribbled over in the shared pool after its commit is loaded into the
    engine as good KV. With verify_loads the worker checks what it loaded against the
    committed checksums: the changed block is a load error (recomputed), the others load."""
    keys = sequence_keys(SPEC, list(range(3 * BLOCK)))
    saver = make_worker(guard.socket, StatsRecorder())
    saver.register_kv_caches(kv_caches(5))
    saver.wait_for_save(KVCRConnectorMetadata(saves=[SavePlan("w", (0, 1, 2), (tuple(keys),))]))
    saver.shutdown()
    scribbler = AttachClient(guard.socket, SPEC, 2 * PAGE)
    lease = scribbler.acquire(keys, checksums=True)
    slots = tuple(s for s in lease.slots if s is not None)
    assert lease.granted == 3 and len(lease.checksums) == 3
    scribbler.pool().view(slots[1])[100:108] = b"scribble"  # after the commit
    stats = StatsRecorder()
    loader = make_worker(guard.socket, stats)
    caches = kv_caches(6)
    loader.register_kv_caches(caches)
    loader.start_load_kv(KVCRConnectorMetadata(loads=[LoadPlan(
        "r", (7, 8, 9), (slots,), checksums_by_rank=(lease.checksums,))]))
    assert loader.get_block_ids_with_load_errors() == {8}
    assert stats.take().data["failures"]["load_checksum"] == 1  # type: ignore[union-attr]
    scribbler.release(lease.op)
    scribbler.close()
    loader.shutdown()
