"""The worker side with a hybrid model's KV cache groups (layers of two groups sharing KV
tensors, as vLLM's hybrid memory manager lays them out) and a real kvcr-guard: each group's
pages are saved into and loaded from its own namespace byte-exactly, and a request is reported
loaded once every group's plan is."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch", reason="torch comes with vLLM (scripts/setup.sh)")
pytest.importorskip("vllm", reason="the worker imports vLLM's metadata base classes")

from kvcr_core.attach import AttachClient  # noqa: E402
from kvcr_core.copyengine import CopyJob, CpuCopyEngine  # noqa: E402
from kvcr_core.keys import NamespaceSpec, sequence_keys  # noqa: E402
from kvcr_vllm.metadata import KVCRConnectorMetadata, LoadPlan, SavePlan  # noqa: E402
from kvcr_vllm.settings import ConnectorSettings, KVGroup, namespaces_for  # noqa: E402
from kvcr_vllm.stats import StatsRecorder  # noqa: E402
from kvcr_vllm.worker import KVCRConnectorWorker  # noqa: E402

NUM_BLOCKS, HEADS, BLOCK, HEAD2 = 16, 2, 32, 128  # CPU layout [blocks, heads, tokens, 2*hd]
PAGE = HEADS * BLOCK * HEAD2 * 4
LAYERS = (("model.layers.0.attn", "model.layers.2.attn"),  # group 0: sliding window
          ("model.layers.1.attn", "model.layers.3.attn"))  # group 1: full attention
GROUPS = [KVGroup(LAYERS[0], "sliding_window:64", 2 * PAGE), KVGroup(LAYERS[1], "full", 2 * PAGE)]
SPECS = namespaces_for(NamespaceSpec(
    model_id="unit", dtype="float32", kv_dtype="float32", block_size_tokens=BLOCK,
    num_layers=4, num_kv_heads=HEADS, head_dim=64, layout="test/cpu"), GROUPS)


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    """Layer i of both groups shares one tensor (vLLM's hybrid layout)."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn(2, NUM_BLOCKS, HEADS, BLOCK, HEAD2, generator=gen)
    return {name: storage[i] for group in LAYERS for i, name in enumerate(group)}


def make_worker(socket: str, copy_engine: CpuCopyEngine | None = None) -> KVCRConnectorWorker:
    settings = ConnectorSettings.from_extra_config({"mode": "guarded", "socket": socket}, "e")
    return KVCRConnectorWorker(settings, SPECS, 0, 2 * PAGE, NUM_BLOCKS, StatsRecorder(),
                               "engine", groups=[g.layer_names for g in GROUPS],
                               copy_engine=copy_engine)


def slots(socket: str, ns: int, keys: list[bytes]) -> tuple[int, ...]:
    reader = AttachClient(socket, SPECS, 2 * PAGE)
    lease = reader.acquire(keys, ns)
    reader.release(lease.op, ns)
    reader.close()
    assert lease.granted == len(keys)
    return tuple(int(s) for s in lease.slots if s is not None)


def test_each_group_moves_its_own_pages_through_its_own_namespace(guard) -> None:
    """Risk: a group's pages copied from another group's layers or block ids (the sliding
    window's KV loaded into full-attention layers), or filed in another group's namespace."""
    window_keys = sequence_keys(SPECS[0], list(range(2 * BLOCK)))
    full_keys = sequence_keys(SPECS[1], list(range(2 * BLOCK)))
    a_caches, b_caches = kv_caches(1), kv_caches(2)
    a, b = make_worker(guard.socket), make_worker(guard.socket)
    a.register_kv_caches(a_caches)
    b.register_kv_caches(b_caches)
    b_before = {name: t.clone() for name, t in b_caches.items()}
    a.wait_for_save(KVCRConnectorMetadata(saves=[
        SavePlan("r1", (3, 4), (tuple(window_keys),), group=0),
        SavePlan("r1", (5, 6), (tuple(full_keys),), group=1)]))
    assert a.sealer.flush(10)
    report = a.report()
    assert report is not None and report.saved_keys == {*window_keys, *full_keys}
    a.shutdown()
    b.start_load_kv(KVCRConnectorMetadata(loads=[
        LoadPlan("r2", (9, 10), (slots(guard.socket, 0, window_keys),), group=0),
        LoadPlan("r2", (11, 12), (slots(guard.socket, 1, full_keys),), group=1)]))
    assert b.get_finished(set()) == (None, {"r2"})
    assert b.get_block_ids_with_load_errors() == set()
    for name in LAYERS[0]:
        assert torch.equal(b_caches[name][9:11], a_caches[name][3:5])
    for name in LAYERS[1]:
        assert torch.equal(b_caches[name][11:13], a_caches[name][5:7])
    for name, tensor in b_caches.items():  # nothing else written
        assert torch.equal(tensor[:9], b_before[name][:9])
        assert torch.equal(tensor[13:], b_before[name][13:])
    b.shutdown()


class HeldJob:
    """A copy job that completes when the test says (a CUDA event still pending)."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.finished = True


class HeldCopies(CpuCopyEngine):
    """Asynchronous copies whose completion the test controls."""

    asynchronous = True

    def __init__(self) -> None:
        super().__init__()
        self.job = HeldJob()

    def record(self) -> CopyJob:
        return self.job


def test_a_request_is_reported_loaded_only_once_every_group_plan_is(guard) -> None:
    """Risk: one group's plan failing at once (its blocks recomputed) reports the request
    loaded while another group's copy is still in flight: vLLM would run the forward pass on
    that group's unwritten blocks."""
    full_keys = sequence_keys(SPECS[1], list(range(BLOCK)))
    a = make_worker(guard.socket)
    a.register_kv_caches(kv_caches(3))
    a.wait_for_save(KVCRConnectorMetadata(saves=[SavePlan("w", (1,), (tuple(full_keys),),
                                                          group=1)]))
    assert a.sealer.flush(10)
    a.shutdown()
    engine = HeldCopies()
    b = make_worker(guard.socket, copy_engine=engine)
    b.register_kv_caches(kv_caches(4))
    b.start_load_kv(KVCRConnectorMetadata(loads=[
        LoadPlan("r", (NUM_BLOCKS + 2,), ((0,),), group=0),  # no such block: fails at once
        LoadPlan("r", (3,), (slots(guard.socket, 1, full_keys),), group=1)]))
    assert b.get_finished(set()) == (None, None)  # the full group's copy is in flight
    engine.job.finished = True
    assert b.get_finished(set()) == (None, {"r"})
    assert b.get_block_ids_with_load_errors() == {NUM_BLOCKS + 2}
    b.shutdown()


def test_an_mla_group_is_written_by_rank_0_once_and_read_by_every_rank(guard) -> None:
    """Risk: each TP rank saving the same latent KV (TP times the bytes and pool room), or a
    rank other than 0 reading nothing or another rank's slots."""
    from kvcr_vllm.settings import rank_namespaces

    base = [NamespaceSpec(model_id="mla", dtype="float32", kv_dtype="float32",
                          block_size_tokens=BLOCK, num_layers=2, num_kv_heads=1, head_dim=64,
                          layout="test/cpu", tp_size=2, tp_rank=r) for r in (0, 1)]
    spaces = rank_namespaces(base, [KVGroup(LAYERS[0], "mla", 2 * PAGE)])
    settings = ConnectorSettings.from_extra_config({"mode": "guarded", "socket": guard.socket},
                                                   "e")

    def rank(r: int, caches: dict[str, torch.Tensor]) -> KVCRConnectorWorker:
        worker = KVCRConnectorWorker(settings, spaces.of_rank(r), r, 2 * PAGE, NUM_BLOCKS,
                                     StatsRecorder(), "engine", groups=[LAYERS[0]],
                                     writes=[spaces.writes(r, 0)])
        worker.register_kv_caches({name: caches[name] for name in LAYERS[0]})
        return worker

    keys = tuple(sequence_keys(spaces.specs[0], list(range(3 * BLOCK))))
    source = kv_caches(5)
    writers = [rank(0, source), rank(1, kv_caches(6))]  # (other bytes: a write by rank 1
    saves = KVCRConnectorMetadata(saves=[SavePlan("w", (2, 3, 4), (keys, keys))])  # shows)
    for worker in reversed(writers):  # rank 1 first: had it written, its bytes would stay
        worker.bind(saves)
        worker.wait_for_save(saves)
        assert worker.sealer.flush(10)
    reports = [worker.report() for worker in writers]
    assert reports[0] is not None and reports[0].saved_keys == set(keys)
    assert reports[1] is None  # rank 1 reserved and wrote nothing
    for worker in writers:
        worker.shutdown()
    reader = AttachClient(guard.socket, spaces.specs, 2 * PAGE)
    assert reader.stats().ready_blocks == 3  # one copy, not one per rank
    reader.close()
    slots = slots_of_shared(guard.socket, spaces.specs, list(keys))
    for r in (0, 1):
        caches = kv_caches(7 + r)
        loader = rank(r, caches)
        loader.start_load_kv(KVCRConnectorMetadata(loads=[LoadPlan(
            "r", (9, 10, 11), (slots, slots), synchronous=True)]))
        assert loader.report() is not None
        for name in LAYERS[0]:
            assert torch.equal(caches[name][9:12], source[name][2:5])
        loader.shutdown()


def slots_of_shared(socket: str, specs: tuple[NamespaceSpec, ...],
                    keys: list[bytes]) -> tuple[int, ...]:
    reader = AttachClient(socket, list(specs), 2 * PAGE)
    lease = reader.acquire(keys)
    reader.release(lease.op)
    reader.close()
    return tuple(int(s) for s in lease.slots if s is not None)
