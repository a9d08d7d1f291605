"""Router core: the indexer under loss, reordering and restarts; cost model and source choice."""

from __future__ import annotations

import random

import pytest

from kvcr_core.errors import ConfigError
from kvcr_router.cost import CostWeights, WorkerLoad, choose, evaluate
from kvcr_router.indexer import BlockIndexer, Tier

pytestmark = pytest.mark.unit

H = list(range(100, 140))  # the prompt's 40 router hashes


def test_indexer_applies_in_order_and_ignores_stale_batches() -> None:
    """Reordered or duplicated batches change nothing; removals and stores apply."""
    idx = BlockIndexer()
    assert idx.apply("w1", Tier.POOL, 7, 1, H[:10], [])
    assert idx.apply("w1", Tier.POOL, 7, 2, H[10:20], [H[15]])
    assert not idx.apply("w1", Tier.POOL, 7, 2, H[20:30], [])  # duplicate
    assert not idx.apply("w1", Tier.POOL, 7, 1, [], H[:10])  # late reordered batch
    assert idx.prefix("w1", Tier.POOL, H) == 15
    assert idx.run_from("w1", Tier.POOL, H, 16) == 20


def test_indexer_clears_on_loss_reset_and_restart() -> None:
    """A gap, a reset or a new epoch drop the source's view (never over-credit), then rebuild."""
    idx = BlockIndexer()
    idx.apply("w1", Tier.POOL, 7, 1, H[:10], [])
    idx.apply("w1", Tier.POOL, 7, 3, H[20:22], [])  # seq 2 lost
    assert idx.prefix("w1", Tier.POOL, H) == 0 and idx.run_from("w1", Tier.POOL, H, 20) == 22
    idx.apply("w1", Tier.POOL, 7, 4, H[:5], [])
    idx.apply("w1", Tier.POOL, 8, 1, H[:2], [])  # restarted runner
    assert idx.prefix("w1", Tier.POOL, H) == 2
    idx.apply("w1", Tier.POOL, 8, 2, H[2:4], [], reset=True)
    assert idx.prefix("w1", Tier.POOL, H) == 0 and idx.clears == 3


def test_indexer_is_bounded() -> None:
    """Past the bound the oldest hashes are forgotten."""
    idx = BlockIndexer(max_blocks_per_source=5)
    idx.apply("w", Tier.DEVICE, 1, 1, range(10), [])
    assert idx.prefix("w", Tier.DEVICE, list(range(10))) == 0
    assert idx.run_from("w", Tier.DEVICE, list(range(10)), 5) == 10


def fleet() -> BlockIndexer:
    idx = BlockIndexer()
    idx.apply("a", Tier.DEVICE, 1, 1, H[:30], [])  # a holds 30 blocks on its GPU
    idx.apply("b", Tier.POOL, 1, 1, H[:8], [])  # b holds 8 in its node pool
    idx.apply("c", Tier.POOL, 1, 1, H[:3] + H[5:25], [])  # c has a hole at 3..4
    return idx


def test_fetch_credit_picks_the_source_in_the_same_pass() -> None:
    """Each candidate's fetch source is the peer whose run extends its local prefix furthest."""
    cands = {c.worker: c for c in evaluate(fleet(), H, ["a", "b", "c"], {}, CostWeights())}
    assert (cands["a"].local, cands["a"].fetch, cands["a"].source) == (30, 0, None)
    assert (cands["b"].local, cands["b"].fetch, cands["b"].source) == (8, 22, "a")
    assert (cands["c"].local, cands["c"].fetch, cands["c"].source) == (3, 27, "a")


def test_source_never_bridges_a_hole() -> None:
    """A peer whose blocks start after a gap in the destination's prefix is not a source."""
    idx = BlockIndexer()
    idx.apply("d", Tier.POOL, 1, 1, H[:4], [])
    idx.apply("p", Tier.POOL, 1, 1, H[6:20], [])  # holds 6.., but not 4 and 5
    (cand,) = evaluate(idx, H, ["d"], {}, CostWeights())
    assert cand.fetch == 0 and cand.source is None


def test_cost_balances_cache_credit_against_load_and_hints_past_the_crossover() -> None:
    """A loaded cache holder loses to an idle worker that can fetch; the hint names the
    holder only when the fetch lead reaches `min_fetch_blocks`."""
    loads = {"a": WorkerLoad(decode_blocks=40)}
    decision = choose(fleet(), H, ["a", "b"], loads, CostWeights())
    assert decision.worker == "b" and decision.hint_source == "a"
    assert decision.hint_range == (8, 30)
    small = choose(fleet(), H, ["a", "b"], loads, CostWeights(min_fetch_blocks=30))
    assert small.worker == "b" and small.hint_source is None
    assert choose(fleet(), H, ["a", "b"], {}, CostWeights()).worker == "a"


def test_ties_are_deterministic_and_temperature_samples() -> None:
    """Equal costs pick the lexically first worker; temperature spreads choices (seeded)."""
    idx = BlockIndexer()
    assert choose(idx, H, ["z", "y", "x"], {}, CostWeights()).worker == "x"
    picks = {choose(idx, H, ["x", "y", "z"], {}, CostWeights(temperature=1.0),
                    rng=random.Random(s)).worker for s in range(30)}
    assert picks == {"x", "y", "z"}


@pytest.mark.parametrize("field", ["device_w", "fetch_w", "temperature", "min_fetch_blocks"])
def test_weights_are_validated(field: str) -> None:
    """A negative or non-finite weight is a config error naming the field."""
    with pytest.raises(ConfigError) as err:
        CostWeights(**{field: -1})
    assert err.value.field == field
    with pytest.raises(ConfigError):
        CostWeights(**{field: float("nan")})
