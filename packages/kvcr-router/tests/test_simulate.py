"""Router simulator: workloads, traces, the modelled fleet and the routing policies."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvcr_core.errors import ConfigError
from kvcr_router.cost import CostWeights
from kvcr_router.indexer import Tier
from kvcr_router.simulate import (
    TUNED_WEIGHTS,
    FleetConfig,
    Policy,
    SimRequest,
    Simulation,
    TraceError,
    WorkloadConfig,
    WorkloadKind,
    generate,
    read_trace,
    write_trace,
)
from kvcr_router.simulate.fleet import Job, LRUTier, SimWorker
from kvcr_router.simulate.report import percentile, summarize
from kvcr_router.simulate.workload import preset

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind", list(WorkloadKind))
def test_generator_is_deterministic_and_well_formed(kind: WorkloadKind) -> None:
    """Same seed, same requests; another seed, others; exact count, sorted, one hash per
    full block."""
    config = WorkloadConfig(kind=kind, requests=300, seed=3)
    first, again = generate(config), generate(config)
    assert first == again
    assert generate(WorkloadConfig(kind=kind, requests=300, seed=4)) != first
    assert len(first) == 300
    assert all(a.arrival_ms <= b.arrival_ms for a, b in itertools.pairwise(first))
    assert all(len(r.hashes) == r.input_tokens // 16 for r in first)


def test_tenant_prompts_share_prefix_chains() -> None:
    """Requests of one tenant share the system prompt's blocks and nothing after them."""
    config = WorkloadConfig(requests=400, tenants=4, seed=1)
    requests = generate(config)
    groups: dict[int, list[SimRequest]] = {}
    for r in requests:
        groups.setdefault(r.hashes[0], []).append(r)
    assert len(groups) == 4
    for group in groups.values():
        shared = len(set.intersection(*(set(r.hashes) for r in group)))
        assert config.system_tokens[0] // 16 <= shared <= config.system_tokens[1] // 16
        assert all(r.hashes[:shared] == group[0].hashes[:shared] for r in group)
        tails = [h for r in group for h in r.hashes[shared:]]
        assert len(set(tails)) == len(tails)  # user parts are private


def test_multi_turn_turns_extend_the_previous_prompt() -> None:
    """A later turn's prompt starts with an earlier turn's full blocks (history reuse)."""
    requests = generate(WorkloadConfig(kind=WorkloadKind.MULTI_TURN, requests=600, seed=2))
    earlier: dict[int, tuple[int, ...]] = {}  # last block -> the whole earlier prompt
    extended = 0
    for r in requests:
        extended += any(earlier.get(h) == r.hashes[:n] for n, h in enumerate(r.hashes, 1)
                        if n < len(r.hashes))
        earlier[r.hashes[-1]] = r.hashes
    assert extended > 0.3 * len(requests)


def test_workload_config_is_validated() -> None:
    """A bad workload setting is a config error naming the field."""
    with pytest.raises(ConfigError) as err:
        WorkloadConfig(requests=0)
    assert err.value.field == "requests"
    with pytest.raises(ConfigError) as err:
        WorkloadConfig(user_tokens=(10, 5))
    assert err.value.field == "user_tokens"


def test_trace_round_trips_and_sorts(tmp_path: Path) -> None:
    """A Mooncake-style trace reads back what was written, in timestamp order."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 50, "input_length": 1100, "output_length": 7, '
                    '"hash_ids": [1, 2, 3], "extra": "ignored"}\n\n'
                    '{"timestamp": 10.5, "input_length": 600, "output_length": 3, '
                    '"hash_ids": [1, 2]}\n')
    requests = read_trace(path)
    assert requests == [SimRequest(10.5, 600, 3, (1, 2)), SimRequest(50.0, 1100, 7, (1, 2, 3))]
    write_trace(requests, tmp_path / "again.jsonl")
    assert read_trace(tmp_path / "again.jsonl") == requests


@pytest.mark.parametrize(("line", "field"), [
    ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "hash_ids"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}', "timestamp"),
    ('{"timestamp": 1, "input_length": "5", "output_length": 1, "hash_ids": []}',
     "input_length"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}',
     "hash_ids"),
    ('{"timestamp": 1, "input_length": 5,', "<line>"),
])
def test_bad_trace_lines_name_the_line_and_field(tmp_path: Path, line: str, field: str) -> None:
    """A malformed line fails the whole read with the file, line number and field."""
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [9]}'
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert (err.value.line, err.value.field) == (2, field)
    assert f"bad.jsonl:2: field {field!r}" in str(err.value)


def test_lru_tier_honours_capacity() -> None:
    """Storing past capacity evicts the least recently used blocks, and reports them."""
    tier = LRUTier(3)
    assert tier.store([1, 2, 3]) == ([1, 2, 3], [])
    tier.touch([1])
    assert tier.store([4]) == ([4], [2])
    assert (1 in tier, 2 in tier, len(tier)) == (True, False, 3)
    assert LRUTier(0).store([1]) == ([], [])


def _small_fleet(**changes: int | float) -> FleetConfig:
    return FleetConfig(**{"workers": 4, "device_blocks": 600, "pool_blocks": 1500, **changes})


def test_eviction_holds_capacity_and_the_index_matches_the_fleet() -> None:
    """Tiers never exceed capacity; the router's index, fed only by the modelled inventory
    batches, equals what each worker really holds."""
    requests = generate(preset(WorkloadKind.MULTI_TENANT, workers=4, requests=250, seed=5))
    sim = Simulation(_small_fleet(), Policy.KVCR, CostWeights())
    sim.run(requests)
    for name, worker in sim.workers.items():
        assert 0 < len(worker.device) <= 600 and 0 < len(worker.pool) <= 1500
        everything = sorted({h for r in requests for h in r.hashes})
        for tier, held in ((Tier.DEVICE, worker.device), (Tier.POOL, worker.pool)):
            indexed = {h for h in everything if sim.indexer.prefix(name, tier, [h])}
            assert indexed == {h for h in everything if h in held}


def test_round_robin_spreads_requests_evenly() -> None:
    """Round-robin hands out requests in turn: counts differ by at most one."""
    requests = generate(preset(WorkloadKind.BURSTY, workers=4, requests=103, seed=1))
    result = Simulation(_small_fleet(), Policy.ROUND_ROBIN).run(requests)
    assert sorted(result.requests_by_worker.values()) == [25, 26, 26, 26]
    assert [o.worker for o in result.outcomes[:5]] == ["w00", "w01", "w02", "w03", "w00"]


def test_cover_takes_device_then_pool_then_the_hinted_peer_and_stops_at_a_hole() -> None:
    """Reuse is a prefix: own tiers first, then the hint's range from the peer's pool; the
    first block found nowhere ends it."""
    fleet = FleetConfig(workers=2)
    me, peer = SimWorker("w00", fleet), SimWorker("w01", fleet)
    me.device.store([1, 2])
    me.pool.store([1, 2, 3])
    peer.pool.store([4, 5, 6, 8])
    job = Job(0, 0.0, (1, 2, 3, 4, 5, 6, 7, 8), 8 * 16, 1, "w01", (3, 8))
    coverage = me.cover(job, peer)
    assert (coverage.device_blocks, coverage.pool_blocks, coverage.fetched_blocks) == (2, 1, 3)
    assert me.cover(job, None).fetched_blocks == 0
    fetch_ms = me.prefill_ms(job, coverage)
    assert fetch_ms < me.prefill_ms(job, me.cover(job, None))  # fetching beats recompute


def test_fleet_config_is_validated_and_scales_with_block_size() -> None:
    """Bad fleet values name the field; other block sizes keep tokens held and bandwidth."""
    with pytest.raises(ConfigError) as err:
        FleetConfig(device_blocks=0)
    assert err.value.field == "device_blocks"
    big = FleetConfig.scaled(512)
    base = FleetConfig()
    assert big.device_blocks * 512 == base.device_blocks * 16
    assert big.fetch_ms_per_block == pytest.approx(base.fetch_ms_per_block * 32)


def test_kvcr_beats_overlap_only_on_multi_tenant_p90() -> None:
    """On shared system prompts, fetch-credit routing cuts simulated TTFT p90 against the
    reference's overlap-only routing without piling requests onto fewer workers."""
    requests = generate(preset(WorkloadKind.MULTI_TENANT, workers=6, requests=600, seed=7,
                               tenants=32))
    fleet = FleetConfig(workers=6, device_blocks=1500, pool_blocks=4000)
    overlap = summarize("mt", Simulation(fleet, Policy.OVERLAP).run(requests))
    ours = summarize("mt", Simulation(fleet, Policy.KVCR, TUNED_WEIGHTS).run(requests))
    assert ours.fetched > 0 and overlap.fetched == 0
    assert ours.ttft_p90_ms < 0.8 * overlap.ttft_p90_ms
    assert ours.load_imbalance <= 1.1 * overlap.load_imbalance


def test_percentile_is_nearest_rank() -> None:
    """p50/p90 use nearest rank (no interpolation), so reported values are real samples."""
    values = [float(v) for v in range(1, 11)]
    assert (percentile(values, 50), percentile(values, 90), percentile([], 90)) == (5, 9, 0)
    assert json.dumps(percentile(values, 100)) == "10.0"
