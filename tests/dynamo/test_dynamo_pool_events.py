"""kvcr's pool evictions reach NVIDIA Dynamo's router: a real Dynamo 1.6.1 frontend and one
real dynamo.vllm worker whose kvcr pool holds 64 blocks (the tiny model's are 128 KiB), so a
third long prompt (about 32 blocks each) evicts the first one's blocks from kvcr (not from
vLLM's own cache, which is far larger): kvcr announces them removed (`BlockRemoved`, medium
CPU_PINNED) and the router applies it. Skipped (failed where CI=true) without .venv-dynamo.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")

from kvcr_bench.dynamo_rig import DynamoRig, Worker

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

REMOVED = "dynamo_component_kv_cache_events_applied_total"


@pytest.fixture(scope="module")
def small_pool(dynamo_venv: None, tiny_model: str, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[DynamoRig, Worker]]:
    rig = DynamoRig(Path(tmp_path_factory.mktemp("dynamo-events")), tiny_model)
    try:
        rig.frontend()
        worker = rig.worker("a", {"pool_bytes": "8MiB",
                                  "kvcr": {"namespace_pool_bytes": 8 << 20}})
        rig.wait_serving([worker], "warm up")
        yield rig, worker
    finally:
        rig.stop()


def test_blocks_kvcr_evicts_are_announced_removed_to_the_router(
        small_pool: tuple[DynamoRig, Worker]) -> None:
    """Risk: the router keeps crediting a worker for blocks kvcr evicted long ago, and sends
    it prompts it must recompute."""
    rig, worker = small_pool
    removed = rig.router_metric(REMOVED, event_type="removed", status="ok")
    for topic in ("first", "second", "third"):
        rig.complete(" ".join(f"{topic}{i}" for i in range(300)), pin=worker.instance_id)
    assert worker.metric("vllm:kvcr_stored_blocks_total") > 64  # more than the pool holds
    deadline = time.monotonic() + 30
    while rig.router_metric(REMOVED, event_type="removed", status="ok") == removed:
        assert time.monotonic() < deadline, "no BlockRemoved reached the router"
        # the sweep runs on engine steps, at most once a second
        rig.complete("a short one", pin=worker.instance_id, max_tokens=1)
        time.sleep(1.5)
