"""The one hinted-fetch component every engine adapter uses: which run it fetches, from whom,
on every TP rank, and how it ends. Driven through the real RunnerService over an in-process
Runner whose peers are other in-process Runners (kvcr_core.testing: no socket, a manual
clock)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvcr_core.attach import HintedFetcher, HintedRun, Skipped, hinted_run
from kvcr_core.config import KVCRConfig
from kvcr_core.keys import NamespaceSpec, block_keys
from kvcr_core.runner import Runner
from kvcr_core.testing import LoopbackPeers, ManualClock, ObservedRunner, in_process, pattern_block
from kvcr_core.types import FetchStatus

pytestmark = pytest.mark.unit

BLOCK = 4096
A, B, C = "tcp://10.0.0.1:7500", "tcp://10.0.0.2:7500", "tcp://10.0.0.3:7500"


def spec(rank: int, tp: int = 2) -> NamespaceSpec:
    return NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32", block_size_tokens=4,
                         num_layers=2, num_kv_heads=2, head_dim=64, layout="test/v1",
                         tp_size=tp, tp_rank=rank)


def runner() -> Runner:
    return Runner(KVCRConfig(pool_bytes=64 * BLOCK, namespace_pool_bytes=24 * BLOCK),
                  registry=CollectorRegistry())


def keys_of(rank_spec: NamespaceSpec, n: int) -> list[bytes]:
    return list(block_keys(rank_spec.digest(), list(range(4 * n)), 4))


def stocked(specs: list[NamespaceSpec], blocks: int) -> Runner:
    """A peer's Runner holding the first `blocks` blocks of every rank."""
    source = runner()
    for s in specs:
        store = source.open_namespace(s, BLOCK)
        keys = keys_of(s, blocks)
        store.store(keys, [pattern_block(k, BLOCK) for k in keys])
    return source


def test_the_run_extends_the_local_prefix_and_never_crosses_a_hole() -> None:
    """Risk: a fetch of blocks after a gap (useless: a prefix must be contiguous) or from two
    sources at once."""
    assert hinted_run(3, [A, A, None, A]) == HintedRun(A, 3, 5)
    assert hinted_run(0, [A, B, B]) == HintedRun(A, 0, 1)
    assert hinted_run(2, [None, A]) is None and hinted_run(2, []) is None


def test_every_tp_rank_fetches_its_own_shard_of_the_run() -> None:
    """Risk: a hinted fetch fills rank 0 only (the rest of the engine then recomputes, or
    worse, loads a block whose other shards are missing)."""
    specs = [spec(0), spec(1)]
    here, clock = runner(), ManualClock()
    service = ObservedRunner(in_process(here, specs, BLOCK, peers=LoopbackPeers(
        {A: stocked(specs, 6)}, answer_after_polls=2)))
    keys = [keys_of(s, 8) for s in specs]
    stores = service.ops.stores
    stores[0].store(keys[0][:2], [pattern_block(k, BLOCK) for k in keys[0][:2]])
    fetcher = HintedFetcher(service, frozenset({A}), 2.0, clock=clock)
    have = fetcher.local_prefix(keys)
    assert have == 0  # rank 1 holds nothing yet: the shared prefix is empty
    fetch = fetcher.start(keys, hinted_run(have, [A] * 8))
    assert not isinstance(fetch, Skipped)
    assert service.calls["peer_fetch"] == 1  # one ticket for both ranks
    assert fetch.poll() is None  # each rank's fetch answers at its second poll
    summary = fetch.poll()
    assert summary is not None and summary.run == HintedRun(A, 0, 8)
    assert summary.statuses[0] == (FetchStatus.PRESENT,) * 2 + (FetchStatus.OK,) * 4 + (
        FetchStatus.MISSING,) * 2
    assert summary.statuses[1] == (FetchStatus.OK,) * 6 + (FetchStatus.MISSING,) * 2
    assert summary.fetched == 4 and summary.failed == 2
    for store, rank_keys in zip(stores, keys, strict=True):
        assert store.load(rank_keys[:6]) == [pattern_block(k, BLOCK) for k in rank_keys[:6]]
    assert fetcher.local_prefix(keys) == 6


def test_a_source_that_is_not_a_peer_is_never_asked() -> None:
    """Risk: a hint makes kvcr dial an endpoint nobody configured."""
    here = runner()
    client = ObservedRunner(in_process(here, spec(0, 1), BLOCK,
                                       peers=LoopbackPeers({A: None, C: None})))
    fetcher = HintedFetcher(client, frozenset({A}), 2.0)
    keys = [keys_of(spec(0, 1), 4)]
    assert fetcher.start(keys, hinted_run(0, [C] * 4)) is Skipped.NOT_ALLOWED
    assert fetcher.start(keys, None) is Skipped.NO_RUN
    assert client.calls["peer_fetch"] == 0
    # the Runner's own list is the last word: a peer the engine lists but the Runner does not
    stranger = HintedFetcher(client, frozenset({B}), 2.0)
    assert stranger.start(keys, hinted_run(0, [B] * 4)) is Skipped.NOT_ALLOWED


def test_a_silent_peer_costs_at_most_the_deadline_and_a_lost_runner_ends_at_once() -> None:
    """Risk: a request waits forever on a peer that never answers, or on a Runner that is
    gone (vLLM would ask again at every step)."""
    here, clock = runner(), ManualClock()
    client = ObservedRunner(in_process(here, spec(0, 1), BLOCK, peers=LoopbackPeers({A: None})))
    fetcher = HintedFetcher(client, frozenset({A}), 2.0, clock=clock)
    keys = [keys_of(spec(0, 1), 4)]
    fetch = fetcher.start(keys, hinted_run(0, [A] * 4))
    assert not isinstance(fetch, Skipped)
    clock.advance(2.9)
    assert fetch.poll() is None  # within the deadline and the grace second for the answer
    clock.advance(0.2)
    summary = fetch.poll()
    assert summary is not None and summary.statuses == ((FetchStatus.TIMEOUT,) * 4,)
    assert summary.fetched == 0 and summary.failed == 4

    again = fetcher.start(keys, hinted_run(0, [A] * 4))
    assert not isinstance(again, Skipped)
    client.down = True
    lost = again.poll()
    assert lost is not None and lost.statuses == ((FetchStatus.UNREACHABLE,) * 4,)
    assert "runner was lost" in lost.detail
    assert fetcher.start(keys, hinted_run(0, [A] * 4)) is Skipped.UNAVAILABLE
