"""kvcr-guard behind NVIDIA Dynamo 1.6.1 on CPU: one node, a real kvcr-guard serving peers,
two real dynamo.vllm workers in guarded mode sharing its pool, both advertising the guard's
peer port as their hint source (docs/dynamo.md, guarded mode). A real Dynamo frontend routes.
Skipped (failed where CI=true) without .venv-dynamo: bash scripts/setup_dynamo.sh.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")

from kvcr_bench.dynamo_rig import DynamoRig, Worker, low_port
from kvcr_bench.processes import GuardProcess
from kvcr_core.testing import secret_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

SECRET = secret_for("dynamo-guarded-peer-secret-0123456789-abcd")


def guard(workdir: Path, port: int) -> GuardProcess:
    """kvcr-guard with this checkout's code, serving peers on 127.0.0.1:`port`."""
    return GuardProcess(workdir, "--pool-bytes", "512MiB", "--namespace-pool-bytes", "256MiB",
                        "--peer-listen", f"127.0.0.1:{port}", "--log-level", "WARNING",
                        env={"KVCR_PEER_SECRET": SECRET})


class Node:
    def __init__(self, rig: DynamoRig, a: Worker, b: Worker) -> None:
        self.rig, self.a, self.b = rig, a, b


@pytest.fixture(scope="module")
def node(dynamo_venv: None, tiny_model: str,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    workdir = Path(tmp_path_factory.mktemp("dynamo-guarded"))
    rig = DynamoRig(workdir, tiny_model)
    port = low_port()
    daemon = guard(workdir, port)
    extra: dict[str, Any] = {
        "mode": "guarded", "socket": str(workdir / "guard.sock"), "pull_on_miss": False,
        "secondary_tiers": [{"router_capabilities": ["router_hint"], "control_ports": [port],
                             "control_advertise_host": "127.0.0.1"}]}
    try:
        rig.frontend()
        a, b = rig.worker("a", extra), rig.worker("b", extra)
        rig.wait_serving([a, b], "warm up")
        yield Node(rig, a, b)
    finally:
        rig.stop()
        daemon.stop()


def test_workers_sharing_kvcr_guard_reuse_each_others_prompts_under_dynamo(node: Node) -> None:
    """Risk: under Dynamo, guarded workers of one node miss each other's prompts, or treat
    Dynamo's hint naming their own (shared) guard endpoint as a refused stranger; or the
    advertised control port is not the guard's and nobody notices."""
    rig, a, b = node.rig, node.a, node.b
    prompt = " ".join(f"shared{i}" for i in range(300))
    on_a = rig.complete(prompt, pin=a.instance_id)
    loaded = b.metric("vllm:kvcr_loaded_tokens_total")
    on_b = rig.complete(prompt, pin=b.instance_id)
    usage = on_b["usage"]
    hit = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert hit >= 0.95 * usage["prompt_tokens"] - 32
    assert on_b["choices"][0]["text"] == on_a["choices"][0]["text"]
    assert b.metric("vllm:kvcr_loaded_tokens_total") - loaded >= hit  # the shared pool
    assert b.metric("vllm:kvcr_failures_total", reason="peer_not_allowed") == 0
    assert b.metric("vllm:kvcr_peer_fetched_blocks_total") == 0
    for worker in (a, b):
        assert "kvcr-guard serves" not in worker.log_path.read_text(errors="replace")
