"""`kvcr bench dynamo`: multi-turn shared-prefix traffic through a real NVIDIA Dynamo 1.6.1
frontend (`--router-mode kv`) over two dynamo.vllm CPU workers, vanilla and with kvcr (each
worker's embedded runner serving the other, Dynamo's router hints on), in one run.

Each conversation's first turn (a new long prompt) is pinned to worker A; its second turn
(the first turn plus a question) goes once to worker B (the other worker: with kvcr, B
fetches the prefix from A on Dynamo's hint, over NIXL where it is installed, as docs/dynamo.md
advises for workers on one node, else TCP) and once to A (a same-worker prefix hit). Time
to first token = wall time of a one-token completion. Reports p50/p90 per case and the share
of B's prompt tokens served from cache; target: kvcr's second turn on the other worker
within 1.2x of a same-worker prefix hit. Needs .venv-dynamo (scripts/setup_dynamo.sh).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvcr_bench.copies import meets
from kvcr_bench.dynamo_rig import DynamoRig, low_port, missing
from kvcr_bench.tiny_model import build
from kvcr_core.peers.nixl_engine import nixl_installed
from kvcr_core.testing import secret_for

TARGETS = {"ttft_ratio_other_worker_vs_same_worker_kvcr": ("<=", 1.2)}
SECRET = secret_for("kvcr-bench-dynamo-peer-secret-0123456789abcdef")


def _turns(i: int) -> tuple[str, str, str]:
    """Conversation `i` (< 26): a first prompt of about 1,900 tokens (the tiny model's
    tokenizer; the workers' --max-model-len is 2,048), then its two second turns."""
    first = " ".join(f"topic{chr(ord('a') + i)}x{j}" for j in range(300))
    return first, f"{first} and then question{i} other", f"{first} and then question{i} same"


def _timed(rig: DynamoRig, prompt: str, pin: int) -> dict[str, Any]:
    start = time.perf_counter()
    reply = rig.complete(prompt, pin=pin, max_tokens=1)
    usage = reply["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"seconds": time.perf_counter() - start, "cached": cached,
            "prompt_tokens": usage["prompt_tokens"]}


def _run(model: str, conversations: int, kvcr: bool) -> dict[str, list[dict[str, Any]]]:
    rig = DynamoRig(Path(tempfile.mkdtemp(prefix="kvcrbd", dir="/tmp")), model)
    ports = {"a": low_port(), "b": low_port()}

    def extra(me: str, other: str) -> dict[str, Any] | None:
        if not kvcr:
            return None
        return {"pool_bytes": "512MiB", "prefault": True, "peer_listen": f"127.0.0.1:{ports[me]}",
                "peers": [f"tcp://127.0.0.1:{ports[other]}"], "pull_on_miss": False,
                "peer_nixl": nixl_installed(),
                "secondary_tiers": [{"router_capabilities": ["router_hint"],
                                     "control_ports": [ports[me]],
                                     "control_advertise_host": "127.0.0.1"}]}

    rows: dict[str, list[dict[str, Any]]] = {"first": [], "other": [], "same": []}
    try:
        rig.frontend()
        env = {"KVCR_PEER_SECRET": SECRET}
        a, b = rig.worker("a", extra("a", "b"), env), rig.worker("b", extra("b", "a"), env)
        rig.wait_serving([a, b], "warm up")
        for i in range(conversations):
            first, other, same = _turns(i)
            rows["first"].append(_timed(rig, first, a.instance_id))
            rows["other"].append(_timed(rig, other, b.instance_id))
            rows["same"].append(_timed(rig, same, a.instance_id))
    finally:
        rig.stop()
    return rows


def _spread(rows: list[dict[str, Any]]) -> dict[str, float]:
    ms = sorted(1000 * r["seconds"] for r in rows)
    return {"p50": float(statistics.median(ms)),
            "p90": ms[min(len(ms) - 1, -(-9 * len(ms) // 10) - 1)], "max": ms[-1]}


def run_dynamo_bench(*, quick: bool, as_json: bool) -> int:
    reason = missing()
    if reason is not None:
        print(f"kvcr bench dynamo: {reason}", file=sys.stderr)
        return 2
    model = str(build(Path(".cache/models") / "tiny-test", "test"))
    conversations = 3 if quick else 15
    print("bench dynamo: vanilla workers ...", file=sys.stderr, flush=True)
    vanilla = _run(model, conversations, kvcr=False)
    print("bench dynamo: kvcr workers ...", file=sys.stderr, flush=True)
    kvcr = _run(model, conversations, kvcr=True)
    spread = {name: {case: _spread(rows) for case, rows in run.items()}
              for name, run in (("vanilla", vanilla), ("kvcr", kvcr))}
    served = sum(r["cached"] for r in kvcr["other"]) / sum(r["prompt_tokens"]
                                                           for r in kvcr["other"])
    summary = {
        "ttft_ratio_other_worker_vs_same_worker_kvcr":
            spread["kvcr"]["other"]["p50"] / spread["kvcr"]["same"]["p50"],
        "ttft_ratio_other_worker_kvcr_vs_vanilla":
            spread["kvcr"]["other"]["p50"] / spread["vanilla"]["other"]["p50"],
        "other_worker_prompt_share_cached_kvcr": served,
        "other_worker_prompt_share_cached_vanilla":
            sum(r["cached"] for r in vanilla["other"])
            / sum(r["prompt_tokens"] for r in vanilla["other"])}
    transport = "NIXL" if nixl_installed() else "TCP (NIXL is not installed)"
    result = {"bench": "dynamo", "quick": quick, "conversations": conversations,
              "peer_transport": transport,
              "spread_ms": spread, "summary": summary,
              "targets": {k: f"{op} {v:g}" for k, (op, v) in TARGETS.items()},
              "meets_targets": {k: meets(TARGETS, k, summary[k]) for k in TARGETS}}
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"kvcr bench dynamo{' --quick' if quick else ''}: {conversations} conversations "
          f"through Dynamo 1.6.1 (kv router), two CPU workers, tiny model, peer transport "
          f"{transport}; TTFT in ms")
    print(f"  {'workers':8} {'case':34} {'p50':>8} {'p90':>8} {'max':>8}")
    for name in ("vanilla", "kvcr"):
        for case, label in (("first", "turn 1 (new prompt) on A"),
                            ("other", "turn 2 on the other worker (B)"),
                            ("same", "turn 2 on the same worker (A)")):
            row = spread[name][case]
            print(f"  {name:8} {label:34} {row['p50']:>8.1f} {row['p90']:>8.1f} "
                  f"{row['max']:>8.1f}")
    for key, value in summary.items():
        target = TARGETS.get(key)
        verdict = ("" if target is None else
                   f"   target {target[0]} {target[1]:g}  "
                   + ("meets" if meets(TARGETS, key, value) else "MISSES"))
        print(f"{key:44} {value:>7.3f}{verdict}")
    return 0
