"""`kvcr bench pull`: cross-node reuse without a router, on real vLLM CPU engines.

Engine A (embedded, serving peers) answers a set of prompts and stays up. Engine B
(embedded, A as its peer, no router) then takes, in one run: prompts A served, with no hint
(pull on miss: B's Runner follows A's inventory); other prompts A served, each with a KV hint
naming A (what a router would send); and each pulled prompt a second time (a hit in B's own
prefix cache: the best case). TTFT = wall time of `generate(max_tokens=1)`, medians and
spread. The break-even run length for pull on miss: B pulls n-block prompts (`pull_min_blocks`
1) against recomputing n-block prompts nobody holds, for growing n.

In-process (two embedded Runners, no engine): the time from a block's commit on A to B's
Runner knowing it (p50, p99), and the follower's memory per 100k peer blocks.
"""

from __future__ import annotations

import array
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from kvcr_bench.tiny_model import PRESETS, build
from kvcr_bench.vllm_ttft import _probe
from kvcr_core.testing import secret_for
from kvcr_core.testing.ports import free_port

SECRET = secret_for("kvcr-bench-pull-secret-0123456789abcdef")
TARGETS = {"ttft_ratio_pull_vs_hint": ("<=", 1.2)}


def _spread(rows: list[dict[str, Any]]) -> dict[str, float]:
    ms = sorted(1000 * r["seconds"] for r in rows)
    return {"p50_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1],
            "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))]}


def _hint(prompt: list[int], model: str, endpoint: str) -> dict[str, Any]:
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # stdout is the report's (and --json's)
    from vllm.engine.arg_utils import EngineArgs

    from kvcr_core.keys import router_hashes, sequence_keys
    from kvcr_vllm.settings import namespace_for

    config = EngineArgs(model=model, dtype="float32", max_model_len=len(prompt) + 64,
                        block_size=32, enforce_eager=True).create_engine_config()
    hashes = router_hashes(sequence_keys(namespace_for(config, 0), prompt))
    return {"kv_hint": {"protocol_version": "0.1", "message_id": "bench", "actions": [{
        "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": endpoint, "block_hashes": hashes}}]}}


def _know_latency(samples: int) -> dict[str, float]:
    """Seconds from a commit on runner A to runner B's directory naming A for it."""
    from kvcr_core.attach import AttachClient, EmbeddedRunner, EngineSettings
    from kvcr_core.keys import NamespaceSpec, block_keys
    from kvcr_core.testing import pattern_block

    os.environ["KVCR_PEER_SECRET"] = SECRET
    spec = NamespaceSpec(model_id="bench", dtype="float32", kv_dtype="float32",
                         block_size_tokens=4, num_layers=1, num_kv_heads=1, head_dim=64,
                         layout="bench/pull")
    port_a, port_b = free_port(), free_port()
    runners = []
    for name, port, peer in (("a", port_a, port_b), ("b", port_b, port_a)):
        fields = EngineSettings.fields_from(
            {"peer_listen": f"127.0.0.1:{port}", "peers": [f"tcp://127.0.0.1:{peer}"],
             "pool_bytes": 64 << 20}, field="bench",
            default_socket=f"\0kvcr-bench-pull-{name}-{os.getpid()}")
        runners.append(EmbeddedRunner(EngineSettings(**fields)))
    a_client = AttachClient(runners[0].socket_path, spec, 4096)
    b_client = AttachClient(runners[1].socket_path, spec, 4096)
    waits = []
    try:
        for i in range(samples):
            keys = list(block_keys(spec.digest(), list(range(i * 8, i * 8 + 8)), 4))
            a_client.store(keys, [pattern_block(k, 4096) for k in keys])
            start = time.perf_counter()
            while b_client.remote_run(keys) is None:
                time.sleep(0.001)
            waits.append(time.perf_counter() - start)
            time.sleep(random.Random(i).random() * 0.05)  # commits at arbitrary moments
    finally:
        a_client.close()
        b_client.close()
        for r in runners:
            r.stop()
    waits.sort()
    return {"p50_ms": 1000 * statistics.median(waits),
            "p99_ms": 1000 * waits[min(len(waits) - 1, int(0.99 * len(waits)))]}


def _follower_bytes_per_block(blocks: int = 100_000) -> float:
    from kvcr_core.inventory import InventoryBatch
    from kvcr_core.peers.directory import PeerView

    rng = random.Random(5)
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    view = PeerView()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    view.apply(1, False, [InventoryBatch(i // 4096 + 1, bytes(16),
                                         array.array("Q", hashes[i:i + 4096]), array.array("Q"))
                          for i in range(0, blocks, 4096)], blocks)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / blocks


def run_pull_bench(*, quick: bool, as_json: bool) -> int:
    preset = "bench"
    model = str(build(Path(".cache/models") / f"tiny-{preset}", preset))
    spec = PRESETS[preset]
    tokens, n = (2048, 2) if quick else (4096, 5)
    rng = random.Random(23)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(10, spec["vocab_size"] - 10) for _ in range(length)]

    pulled, hinted = [prompt(tokens) for _ in range(n)], [prompt(tokens) for _ in range(n)]
    sizes = (1, 2, 4, 8) if quick else (1, 2, 4, 8, 16, 32)
    repeats = 1 if quick else 3
    short_served = [prompt(32 * s + 8) for s in sizes for _ in range(repeats)]
    short_fresh = [prompt(32 * s + 8) for s in sizes for _ in range(repeats)]
    base = {"model": model, "max_model_len": spec["max_position_embeddings"],
            "max_num_batched_tokens": 8192}
    print("bench pull: engine A serves, engine B pulls / is hinted / hits locally ...",
          file=sys.stderr, flush=True)
    endpoint_marker = "{A}"
    b_requests: list[dict[str, Any]] = []
    for p in pulled:
        b_requests += [{"tokens": p, "max_tokens": 1}] * 2  # pulled, then B's own prefix hit
    b_requests += [{"tokens": p, "max_tokens": 1, "hint": endpoint_marker} for p in hinted]
    for served, fresh in zip(short_served, short_fresh, strict=True):
        b_requests += [{"tokens": fresh, "max_tokens": 1}, {"tokens": served, "max_tokens": 1}]
    rows = _run(base, model, [*pulled, *hinted, *short_served], b_requests)
    pull_rows, local_rows = rows[0:2 * n:2], rows[1:2 * n:2]
    hint_rows = rows[2 * n:3 * n]
    short = rows[3 * n:]
    break_even = []
    for i, s in enumerate(sizes):
        pairs = short[2 * repeats * i:2 * repeats * (i + 1)]
        recomputed, pulled_rows = pairs[0::2], pairs[1::2]
        break_even.append({
            "blocks": s, "recompute_ms": 1000 * statistics.median(r["seconds"] for r in recomputed),
            "pull_ms": 1000 * statistics.median(r["seconds"] for r in pulled_rows),
            "pulled": all(r["cached"] >= 32 * s for r in pulled_rows)})
    know = _know_latency(40 if quick else 200)
    summary: dict[str, Any] = {
        "ttft_pull_ms": _spread(pull_rows), "ttft_hint_ms": _spread(hint_rows),
        "ttft_local_prefix_ms": _spread(local_rows),
        "ttft_ratio_pull_vs_hint": (_spread(pull_rows)["p50_ms"]
                                    / _spread(hint_rows)["p50_ms"]),
        "ttft_ratio_pull_vs_local_prefix": (_spread(pull_rows)["p50_ms"]
                                            / _spread(local_rows)["p50_ms"]),
        "pull_hit_tokens_min": min(r["cached"] for r in pull_rows),
        "hint_hit_tokens_min": min(r["cached"] for r in hint_rows),
        "break_even": break_even,
        "commit_to_known_ms": know,
        "follower_bytes_per_block": _follower_bytes_per_block(),
    }
    return _report(summary, quick=quick, as_json=as_json, tokens=tokens, n=n)


def _run(base: dict[str, Any], model: str, served: list[list[int]],
         b_requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Engine B's rows; hint markers become real hints naming engine A."""
    port_a = free_port()
    requests = []
    for req in b_requests:
        req = dict(req)
        if req.pop("hint", None):
            req["params"] = _hint(req["tokens"], model, f"tcp://127.0.0.1:{port_a}")
        requests.append(req)
    return _engines_on(base, served, requests, port_a)


def _engines_on(base: dict[str, Any], served: list[list[int]],
                b_requests: list[dict[str, Any]], port_a: int) -> list[dict[str, Any]]:
    import subprocess

    port_b = free_port()
    env = {**os.environ, "KVCR_PEER_SECRET": SECRET}
    job_a = {**base, "connector": "plugin", "hold": True,
             "extra": {"peer_listen": f"127.0.0.1:{port_a}"},
             "requests": [{"tokens": p, "max_tokens": 1} for p in served]}
    a = subprocess.Popen([sys.executable, "-m", "kvcr_bench.vllm_probe", "-"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert a.stdin is not None and a.stdout is not None
        a.stdin.write(json.dumps(job_a))
        a.stdin.close()
        for line in a.stdout:
            if '"holding"' in line:
                break
        else:
            raise RuntimeError("engine A exited early")
        os.environ["KVCR_PEER_SECRET"] = SECRET
        return _probe({**base, "connector": "plugin", "requests": b_requests, "extra": {
            "peer_listen": f"127.0.0.1:{port_b}", "peers": [f"tcp://127.0.0.1:{port_a}"],
            "fetch_deadline_s": 10, "pull_min_blocks": 1}})
    finally:
        a.kill()
        a.wait(timeout=30)


def _report(summary: dict[str, Any], *, quick: bool, as_json: bool, tokens: int,
            n: int) -> int:
    from kvcr_bench.copies import meets

    if as_json:
        print(json.dumps({"bench": "pull", "quick": quick, "prompt_tokens": tokens,
                          "prompts": n, "summary": summary,
                          "targets": {k: f"{op} {v:g}" for k, (op, v) in TARGETS.items()}},
                         indent=2))
        return 0
    print(f"kvcr bench pull{' --quick' if quick else ''}: engine B reuses engine A's "
          f"{tokens}-token prompts ({n} each), medians [min, p90, max]")
    for label, key in (("pull on miss (no router, no hint)", "ttft_pull_ms"),
                       ("KV hint naming A", "ttft_hint_ms"),
                       ("B's own prefix hit", "ttft_local_prefix_ms")):
        s = summary[key]
        print(f"  {label:36} {s['p50_ms']:8.1f} ms  [{s['min_ms']:.1f}, {s['p90_ms']:.1f}, "
              f"{s['max_ms']:.1f}]")
    print("  break-even (medians): blocks | recompute ms | pull ms")
    for row in summary["break_even"]:
        print(f"    {row['blocks']:>5} | {row['recompute_ms']:>12.1f} | {row['pull_ms']:>7.1f}"
              f"{'' if row['pulled'] else '  (not pulled)'}")
    know = summary["commit_to_known_ms"]
    print(f"commit on A -> B knows it: p50 {know['p50_ms']:.1f} ms, p99 {know['p99_ms']:.1f} ms")
    print(f"follower memory: {summary['follower_bytes_per_block']:.0f} bytes per peer block "
          f"({summary['follower_bytes_per_block'] * 1e5 / 2**20:.1f} MiB per 100k)")
    for name, (op, bound) in TARGETS.items():
        verdict = "meets" if meets(TARGETS, name, summary[name]) else "MISSES"
        print(f"{name:38} {summary[name]:>7.3f}   target {op} {bound:g}  {verdict}")
    return 0
