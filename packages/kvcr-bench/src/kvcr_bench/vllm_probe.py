"""One real vLLM CPU engine (offline `LLM`, in-process engine core) driven by a JSON job,
for the end-to-end tests and `kvcr bench vllm`: `python -m kvcr_bench.vllm_probe JOB_JSON` (or
`-` to read the job from stdin: long prompts exceed the argument size limit).

Job: model, connector ("none"; "plugin" or "module" for KVCRConnector by name or module path;
"example" for vLLM's ExampleConnector), extra config, requests (token id lists with optional
kv_transfer_params, kv_hints (vLLM's own hint envelope, as JSON), max_tokens,
reset_prefix_cache, cache_salt, lora: {"name", "id", "path"}, text with image_rgb),
`enable_lora`, `images` (a vision-language model: one image per prompt), `hold` (then
wait to be killed), `multiprocess` (true: the engine core in a child process, as `vllm serve`
runs it; default in-process), `omp_threads` (the engine's OpenMP threads; default 2) and
`bad_extra` (first try an invalid extra config and report the start-up error). Prints one
JSON line per request: output token ids, cached tokens, wall seconds, returned
kv_transfer_params, the engine's kvcr / prefix-cache metrics after it, and how long the
engine took to start, with its KV blocks and KV cache groups.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("GOMP_SPINCOUNT", "100000")  # as vllm_servers.CPU_ENV (docs/vllm.md)


def transfer_config(job: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any] | None:
    if job["connector"] == "none":
        return None
    if job["connector"] == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": extra}
    cfg = {"kv_connector": "KVCRConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": extra}
    if job["connector"] == "module":
        cfg["kv_connector_module_path"] = "kvcr_vllm.connector"
    return cfg


def make_llm(job: dict[str, Any], extra: dict[str, Any]) -> Any:
    from vllm import LLM

    lora: dict[str, Any] = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2} \
        if job.get("enable_lora") else {}
    if job.get("images"):
        lora["limit_mm_per_prompt"] = {"image": 1}
    return LLM(model=job["model"], dtype="float32", max_model_len=job.get("max_model_len", 4096),
               block_size=32, enforce_eager=True, max_num_seqs=4, enable_prefix_caching=True,
               seed=0, kv_transfer_config=transfer_config(job, extra), disable_log_stats=False,
               max_num_batched_tokens=job.get("max_num_batched_tokens"), **lora)


def metrics(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if "kvcr" in m.name or "prefix_cache" in m.name:
            value = getattr(m, "value", None)
            if value is None and hasattr(m, "sum"):  # a histogram
                value = {"sum": m.sum, "count": m.count}
            out[m.name] = value
        if m.name in ("vllm:kvcr_failures", "vllm:kvcr_hints"):
            out[m.name + "{" + ",".join(f"{k}={v}" for k, v in m.labels.items()
                                        if k in ("reason", "outcome")) + "}"] = m.value
    return out


def hinted_generate(llm: Any, req: dict[str, Any], params: Any, request_id: str) -> Any:
    """One request carrying vLLM's own `kv_hints` (a KvHintsEnvelope, as NVIDIA Dynamo sends
    it; msgspec does not check a struct's fields when it is built, so a malformed one reaches
    the engine as it would from a faulty router), through the engine's add_request/step."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    raw = req["kv_hints"]
    envelope = KvHintsEnvelope(
        protocol_version=raw.get("protocol_version"), message_id=raw.get("message_id"),
        actions=[KvHintAction(**action) for action in raw.get("actions", [])])
    engine = llm.llm_engine
    engine.add_request(request_id, {"prompt_token_ids": req["tokens"]}, params,
                       kv_hints=envelope)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise RuntimeError("the hinted request never finished")


def prompt_of(req: dict[str, Any]) -> dict[str, Any]:
    """The request's prompt: its token ids (or `text` with an `image_rgb`: a 64x64 image of
    that colour for the text's `<image>`), with its `cache_salt` if it has one."""
    if req.get("image_rgb") is not None:
        from PIL import Image

        prompt: dict[str, Any] = {"prompt": req["text"], "multi_modal_data": {
            "image": Image.new("RGB", (64, 64), tuple(req["image_rgb"]))}}
    else:
        prompt = {"prompt_token_ids": req["tokens"]}
    if req.get("cache_salt"):
        prompt["cache_salt"] = req["cache_salt"]
    return prompt


def lora_of(req: dict[str, Any]) -> Any:
    """The request's LoRA adapter (`{"name", "id", "path"}`), or None."""
    if not req.get("lora"):
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(req["lora"]["name"], int(req["lora"]["id"]), req["lora"]["path"])


def kv_cache_shape(llm: Any) -> dict[str, Any]:
    """The engine's KV blocks and KV cache groups (an in-process engine core's; None else)."""
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # in-process only
    config = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
    return {"kv_blocks": blocks,
            "kv_groups": len(config.kv_cache_groups) if config is not None else None}


def main() -> None:
    job = json.loads(sys.stdin.read() if sys.argv[1] == "-" else sys.argv[1])
    if "multiprocess" in job:  # the engine core in a child process, as `vllm serve` runs it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if job["multiprocess"] else "0"
    if "omp_threads" in job:
        os.environ["OMP_NUM_THREADS"] = str(int(job["omp_threads"]))
    from vllm import SamplingParams

    if job.get("bad_extra") is not None:
        try:
            make_llm(job, job["bad_extra"])
            print(json.dumps({"bad_extra_error": None}), flush=True)
        except Exception as exc:  # the start-up error a user would see
            print(json.dumps({"bad_extra_error": f"{type(exc).__name__}: {exc}"}), flush=True)
    began = time.perf_counter()
    llm = make_llm(job, job.get("extra", {}))
    engine_start_s = time.perf_counter() - began
    kv = kv_cache_shape(llm)
    for req in job["requests"]:
        if req.get("reset_prefix_cache"):
            llm.reset_prefix_cache()  # drop vLLM's own cache: a hit now can only be kvcr's
        extra_args = {"kv_transfer_params": req["params"]} if req.get("params") else None
        sp = SamplingParams(temperature=0, max_tokens=req.get("max_tokens", 16), ignore_eos=True,
                            extra_args=extra_args)
        start = time.perf_counter()
        if req.get("kv_hints") is not None:
            out = hinted_generate(llm, req, sp, f"hinted-{start}")
        else:
            out = llm.generate([prompt_of(req)], sp, use_tqdm=False,
                               lora_request=lora_of(req))[0]
        print(json.dumps({"tokens": list(out.outputs[0].token_ids),
                          "cached": out.num_cached_tokens, "seconds": time.perf_counter() - start,
                          "params": out.kv_transfer_params, "metrics": metrics(llm),
                          "engine_start_s": engine_start_s, **kv}), flush=True)
    if job.get("hold"):
        print(json.dumps({"holding": True}), flush=True)
        time.sleep(3600)


if __name__ == "__main__":
    main()
