"""`kvcr bench vllm`: time to first token on the real vLLM CPU engine, in one run, for
(a) recompute (vanilla vLLM, new prompt), (b) a hit in the same engine's prefix cache,
(c) a cross-engine hit through kvcr (engine B loads what engine A stored in kvcr-guard), and
(d) vLLM's ExampleConnector doing the same cross-engine reuse through disk.

Every case runs in its own engine process (cold caches), on the `bench` model preset (a
4k-token prefill takes seconds here). TTFT = wall time of `generate(max_tokens=1)` in the
offline engine: prefill plus the first token, loads included. Medians over several prompts.
Also reports the KV load throughput (bytes moved per second of load time).
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvcr_bench.copies import meets
from kvcr_bench.tiny_model import PRESETS, build
from kvcr_bench.vllm_servers import GuardProcess

TARGETS = {"ttft_ratio_kvcr_vs_recompute": ("<=", 0.15),
           "ttft_ratio_kvcr_vs_local_prefix": ("<=", 1.5),
           "ttft_ratio_kvcr_vs_example_connector": ("<", 1.0)}


def _probe(job: dict[str, Any]) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "kvcr_bench.vllm_probe", "-"],
                         input=json.dumps(job), capture_output=True, text=True, timeout=1800,
                         check=False)
    if out.returncode != 0:
        raise RuntimeError(f"engine failed: {out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _median_seconds(rows: list[dict[str, Any]]) -> float:
    return float(statistics.median(r["seconds"] for r in rows))


def run_vllm_bench(*, quick: bool, as_json: bool) -> int:
    preset = "bench"
    model = str(build(Path(".cache/models") / f"tiny-{preset}", preset))
    spec = PRESETS[preset]
    prompt_tokens, n_prompts = (2048, 2) if quick else (4096, 5)
    rng = random.Random(11)
    prompts = [[rng.randrange(10, spec["vocab_size"] - 10) for _ in range(prompt_tokens)]
               for _ in range(n_prompts)]
    base = {"model": model, "max_model_len": spec["max_position_embeddings"],
            "max_num_batched_tokens": 8192}
    one = [{"tokens": p, "max_tokens": 1} for p in prompts]
    twice = [r for p in prompts for r in ({"tokens": p, "max_tokens": 1},) * 2]
    progress = sys.stderr

    print("bench vllm: (a)+(b) vanilla engine ...", file=progress, flush=True)
    vanilla = _probe({**base, "connector": "none", "requests": twice})
    recompute, local = vanilla[0::2], vanilla[1::2]

    workdir = Path(tempfile.mkdtemp(prefix="kvcrbv", dir="/tmp"))
    guard = GuardProcess(workdir, pool_bytes="4GiB")
    try:
        extra = {"mode": "guarded", "socket": guard.socket}
        print("bench vllm: (c) kvcr engine A stores, engine B loads ...", file=progress,
              flush=True)
        _probe({**base, "connector": "plugin", "extra": extra, "requests": one})
        kvcr = _probe({**base, "connector": "plugin", "extra": extra, "requests": one})
    finally:
        guard.stop()
    store = workdir / "example-store"
    print("bench vllm: (d) ExampleConnector engine A stores, engine B loads ...",
          file=progress, flush=True)
    _probe({**base, "connector": "example", "extra": {"shared_storage_path": str(store)},
            "requests": one})
    example = _probe({**base, "connector": "example",
                      "extra": {"shared_storage_path": str(store)}, "requests": one})

    a, b, c, d = (_median_seconds(x) for x in (recompute, local, kvcr, example))
    last = kvcr[-1]["metrics"]
    hits = [r["cached"] for r in kvcr]
    kv_bytes_per_token = (2 * spec["num_hidden_layers"] * spec["num_key_value_heads"]
                          * spec["head_dim"] * 4)
    load_s = last.get("vllm:kvcr_load_seconds")
    loaded_tokens = last.get("vllm:kvcr_loaded_tokens", 0)
    load_sum = load_s.get("sum") if isinstance(load_s, dict) else None
    summary = {
        "ttft_ratio_kvcr_vs_recompute": c / a,
        "ttft_ratio_kvcr_vs_local_prefix": c / b,
        "ttft_ratio_kvcr_vs_example_connector": c / d,
        "ttft_recompute_ms": 1000 * a, "ttft_local_prefix_ms": 1000 * b,
        "ttft_kvcr_cross_engine_ms": 1000 * c, "ttft_example_connector_ms": 1000 * d,
        "kvcr_hit_tokens_min": min(hits), "example_hit_tokens_min": min(
            r["cached"] for r in example),
        "kv_load_gbps": (loaded_tokens * kv_bytes_per_token / load_sum / 1e9
                         if load_sum else None),
    }
    result = {"bench": "vllm", "quick": quick, "model_preset": preset,
              "prompt_tokens": prompt_tokens, "prompts": n_prompts,
              "kv_bytes_per_token": kv_bytes_per_token, "summary": summary,
              "samples_s": {"recompute": [r["seconds"] for r in recompute],
                            "local_prefix": [r["seconds"] for r in local],
                            "kvcr": [r["seconds"] for r in kvcr],
                            "example_connector": [r["seconds"] for r in example]},
              "targets": {k: f"{op} {v:g}" for k, (op, v) in TARGETS.items()},
              "meets_targets": {k: meets(TARGETS, k, summary[k]) for k in TARGETS}}
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"kvcr bench vllm{' --quick' if quick else ''}: {n_prompts} prompts of "
          f"{prompt_tokens} tokens, model preset '{preset}' "
          f"({kv_bytes_per_token // 1024} KiB of KV per token), medians")
    for label, key in (("(a) recompute", "ttft_recompute_ms"),
                       ("(b) same-engine prefix hit", "ttft_local_prefix_ms"),
                       ("(c) cross-engine via kvcr", "ttft_kvcr_cross_engine_ms"),
                       ("(d) ExampleConnector (disk)", "ttft_example_connector_ms")):
        print(f"  {label:30} {summary[key]:>9.1f} ms")
    for name, (op, bound) in TARGETS.items():
        verdict = "meets" if meets(TARGETS, name, summary[name]) else "MISSES"
        print(f"{name:38} {summary[name]:>7.3f}   target {op} {bound:g}  {verdict}")
    if summary["kv_load_gbps"]:
        print(f"{'kv_load_gbps':38} {summary['kv_load_gbps']:>7.2f}")
    return 0
