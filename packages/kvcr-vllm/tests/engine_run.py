"""One real vLLM CPU engine (offline `LLM`) for the e2e tests; run as a script.

argv[1] is a JSON job: model, connector ("none", "plugin" or "module"), extra config,
requests (token id lists, each with optional kv_transfer_params), `hold` (print results,
then wait to be killed) and `bad_extra` (first try an invalid extra config and report the
start-up error). Prints one JSON line per request: output token ids, cached tokens, and the
engine's kvcr/prefix-cache metrics after it.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "2")


def transfer_config(job: dict, extra: dict) -> dict | None:
    if job["connector"] == "none":
        return None
    cfg = {"kv_connector": "KVCRConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": extra}
    if job["connector"] == "module":
        cfg["kv_connector_module_path"] = "kvcr_vllm.connector"
    return cfg


def make_llm(job: dict, extra: dict):
    from vllm import LLM

    return LLM(model=job["model"], dtype="float32", max_model_len=4096, block_size=32,
               enforce_eager=True, max_num_seqs=4, enable_prefix_caching=True, seed=0,
               kv_transfer_config=transfer_config(job, extra), disable_log_stats=False)


def metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if "kvcr" in m.name or "prefix_cache" in m.name:
            value = getattr(m, "value", None)
            if value is None and hasattr(m, "values"):
                value = m.values
            out[m.name] = value
        if m.name == "vllm:kvcr_failures" or m.name == "vllm:kvcr_hints":
            out[m.name + "{" + ",".join(f"{k}={v}" for k, v in m.labels.items()
                                        if k in ("reason", "outcome")) + "}"] = m.value
    return out


def main() -> None:
    from vllm import SamplingParams

    job = json.loads(sys.argv[1])
    if job.get("bad_extra") is not None:
        try:
            make_llm(job, job["bad_extra"])
            print(json.dumps({"bad_extra_error": None}), flush=True)
        except Exception as exc:  # the start-up error a user would see
            print(json.dumps({"bad_extra_error": f"{type(exc).__name__}: {exc}"}), flush=True)
    llm = make_llm(job, job.get("extra", {}))
    for req in job["requests"]:
        extra_args = {"kv_transfer_params": req["params"]} if req.get("params") else None
        sp = SamplingParams(temperature=0, max_tokens=req.get("max_tokens", 16), ignore_eos=True,
                            extra_args=extra_args)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": req["tokens"]}], sp, use_tqdm=False)[0]
        print(json.dumps({"tokens": list(out.outputs[0].token_ids),
                          "cached": out.num_cached_tokens, "seconds": time.perf_counter() - start,
                          "params": out.kv_transfer_params, "metrics": metrics(llm)}), flush=True)
    if job.get("hold"):
        print(json.dumps({"holding": True}), flush=True)
        time.sleep(3600)


if __name__ == "__main__":
    main()
