"""The README's main job: two vLLM engines sharing one kvcr-guard pool, against vanilla vLLM.

`python -m kvcr_bench.demo [--quick] [--out DIR]`:
1. builds the local model (no hub) and a workload of several users with long shared
   prefixes (one system prompt for all, one document per user) over several turns;
2. runs it on two vanilla vLLM servers (each with its own prefix cache), requests
   alternating between them;
3. runs it again on two vLLM servers with KVCRConnector in guarded mode, attached to one
   kvcr-guard (so each engine reuses what the other computed);
4. prints per-request TTFT and the tokens each request reused, the kvcr counters, and
   writes a PNG chart of TTFT with and without kvcr.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcr_bench.tiny_model import PRESETS, build
from kvcr_bench.vllm_servers import VllmServer, bench_guard, start_servers


@dataclass
class Request:
    user: int
    turn: int
    engine: int
    tokens: list[int]


def workload(users: int, turns: int, system_tokens: int, doc_tokens: int, vocab: int,
             seed: int = 7) -> list[Request]:
    """Turn t of user u = system + document(u) + (question, answer) * t: growing prefixes,
    sent so that a user's consecutive turns land on different engines."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(n)]

    system = text(system_tokens)
    docs = [text(doc_tokens) for _ in range(users)]
    history: list[list[int]] = [[] for _ in range(users)]
    out: list[Request] = []
    for turn in range(turns):
        for user in range(users):
            history[user] += text(48)  # the user's next question
            out.append(Request(user, turn, (user + turn) % 2, system + docs[user] + history[user]))
            history[user] += text(32)  # an answer the user keeps in the conversation
    return out


def run_phase(label: str, servers: list[VllmServer], requests: list[Request]
              ) -> list[dict[str, Any]]:
    rows = []
    for req in requests:
        server = servers[req.engine]
        before = (server.metric("vllm:external_prefix_cache_hits_total"),
                  server.metric("vllm:prefix_cache_hits_total"))
        ttft = server.ttft(req.tokens)
        after = (server.metric("vllm:external_prefix_cache_hits_total"),
                 server.metric("vllm:prefix_cache_hits_total"))
        rows.append({"phase": label, "user": req.user, "turn": req.turn, "engine": req.engine,
                     "prompt_tokens": len(req.tokens), "ttft_s": ttft,
                     "kvcr_tokens": int(after[0] - before[0]),
                     "local_tokens": int(after[1] - before[1])})
    return rows


def chart(rows_plain: list[dict[str, Any]], rows_kvcr: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"u{r['user']} t{r['turn']}\nE{'AB'[r['engine']]}" for r in rows_plain]
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.7), 4.5))
    width = 0.4
    ax.bar([i - width / 2 for i in x], [1000 * r["ttft_s"] for r in rows_plain], width,
           label="vLLM alone (own prefix cache per engine)", color="#999999")
    ax.bar([i + width / 2 for i in x], [1000 * r["ttft_s"] for r in rows_kvcr], width,
           label="vLLM + kvcr (one kvcr-guard pool for both engines)", color="#1f77b4")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("Multi-user, multi-turn chats alternating between two vLLM CPU engines")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(rows_plain: list[dict[str, Any]], rows_kvcr: list[dict[str, Any]],
           counters: dict[str, float]) -> None:
    print(f"{'user':>4} {'turn':>4} {'eng':>3} {'prompt':>6} | {'TTFT alone':>10} "
          f"{'reused':>6} | {'TTFT kvcr':>9} {'reused':>6} {'(kvcr)':>6} | {'speed-up':>8}")
    for p, k in zip(rows_plain, rows_kvcr, strict=True):
        print(f"{p['user']:>4} {p['turn']:>4} {'AB'[p['engine']]:>3} {p['prompt_tokens']:>6} | "
              f"{1000 * p['ttft_s']:>8.0f}ms {p['local_tokens']:>6} | "
              f"{1000 * k['ttft_s']:>7.0f}ms {k['local_tokens'] + k['kvcr_tokens']:>6} "
              f"{k['kvcr_tokens']:>6} | {p['ttft_s'] / k['ttft_s']:>7.1f}x")
    med_p = statistics.median(r["ttft_s"] for r in rows_plain)
    med_k = statistics.median(r["ttft_s"] for r in rows_kvcr)
    print(f"\nmedian TTFT: vLLM alone {1000 * med_p:.0f} ms, with kvcr {1000 * med_k:.0f} ms "
          f"({med_p / med_k:.1f}x)")
    print("kvcr counters (both engines): " + ", ".join(
        f"{k.removeprefix('vllm:')}={v:.0f}" for k, v in counters.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="kvcr demo: two vLLM engines, one kvcr pool")
    ap.add_argument("--quick", action="store_true", help="small model and workload (tests)")
    ap.add_argument("--out", default=".cache/demo", help="where logs, JSON and the chart go")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = "test" if args.quick else "bench"
    model = str(build(Path(".cache/models") / f"tiny-{preset}", preset))
    vocab = PRESETS[preset]["vocab_size"]
    requests = (workload(2, 2, 512, 512, vocab) if args.quick
                else workload(3, 3, 1536, 1024, vocab))
    print(f"kvcr demo: model {model} ({preset}), {len(requests)} requests, "
          f"{len({r.user for r in requests})} users, prompts "
          f"{min(len(r.tokens) for r in requests)}-{max(len(r.tokens) for r in requests)} "
          "tokens, alternating between engines A and B", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvcrdemo", dir="/tmp"))
    print("phase 1/2: two vanilla vLLM servers ...", flush=True)
    servers = start_servers(model, workdir, ["plain-a", "plain-b"], None)
    try:
        rows_plain = run_phase("vllm", servers, requests)
    finally:
        for s in servers:
            s.stop()
    print("phase 2/2: kvcr-guard + two vLLM servers with KVCRConnector (guarded) ...",
          flush=True)
    guard = bench_guard(workdir)
    try:
        ktc = {"kv_connector": "KVCRConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"mode": "guarded", "socket": guard.socket}}
        servers = start_servers(model, workdir, ["kvcr-a", "kvcr-b"], ktc)
        try:
            rows_kvcr = run_phase("kvcr", servers, requests)
            names = ("vllm:kvcr_loaded_tokens_total", "vllm:kvcr_stored_tokens_total",
                     "vllm:kvcr_failures_total", "vllm:external_prefix_cache_hits_total")
            counters = {n: sum(s.metric(n) for s in servers) for n in names}
        finally:
            for s in servers:
                s.stop()
    finally:
        guard.stop()
    report(rows_plain, rows_kvcr, counters)
    chart(rows_plain, rows_kvcr, out / "ttft.png")
    (out / "demo.json").write_text(json.dumps(
        {"rows": rows_plain + rows_kvcr, "counters": counters}, indent=1))
    print(f"\nchart: {out / 'ttft.png'}   data: {out / 'demo.json'}   logs: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
