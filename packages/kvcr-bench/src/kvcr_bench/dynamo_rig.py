"""Real NVIDIA Dynamo 1.6.1 in front of real dynamo.vllm workers with kvcr, on CPU, with no
etcd or NATS (file discovery, TCP request plane, ZMQ event plane), as processes stopped by
PID. Needs .venv-dynamo (scripts/setup_dynamo.sh); used by tests/dynamo and by hand.

`DynamoRig(workdir, model)` owns one discovery store; `frontend()` starts
`python -m dynamo.frontend --router-mode kv`, `worker(name, extra)` a worker with kvcr
(`kv_connector_extra_config` = `extra`), its own KV-event port and metrics port
(DYN_SYSTEM_PORT). Workers run this checkout's kvcr (PYTHONPATH), not the installed one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvcr_bench.processes import Process

REPO = Path(__file__).resolve().parents[4]
VENV = REPO / ".venv-dynamo"
_WORKER_ID = re.compile(rb"Initializing KvEventPublisher for worker (\d+)")
DYNAMO_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false", "DYN_TCP_RPC_HOST": "127.0.0.1",
              "DYN_EVENT_PLANE_HOST": "127.0.0.1"}
_CLEAR = """
import asyncio, json, sys
from dynamo.runtime import DistributedRuntime

async def main():
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    client = await runtime.endpoint("dynamo.backend.clear_kv_blocks").client()
    await asyncio.wait_for(client.wait_for_instances(), 60)
    async for reply in await client.direct(None, int(sys.argv[1])):
        print(json.dumps(reply.data()))

asyncio.run(main())
"""
PLANES = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]


def low_port() -> int:
    """A free port below 32768, outside Linux's ephemeral range (32768-60999), so the ports
    the processes started meanwhile take for themselves never collide with it; and Dynamo
    reads DYN_SYSTEM_PORT as a signed 16-bit number."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free port below 32768")


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def missing() -> str | None:
    """Why the rig cannot run here (None: it can)."""
    for path in (VENV / "bin" / "python", VENV / "bin" / "dynamo-vllm"):
        if not path.exists():
            return f"{path.relative_to(REPO)} is missing: run bash scripts/setup_dynamo.sh"
    return None


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a sample over the label sets that include `labels` (0 if absent)."""
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


class Worker(Process):
    """A dynamo.vllm worker; `instance_id` is what `nvext.backend_instance_id` pins to."""

    def __init__(self, rig: DynamoRig, name: str, extra: dict[str, Any] | None,
                 env: dict[str, str], args: tuple[str, ...] = ()) -> None:
        self.name = name
        self.system_port = low_port()
        self.events_port = low_port()
        kv = [] if extra is None else [  # None: a vanilla worker, no KV connector
            "--kv-transfer-config", json.dumps({"kv_connector": "KVCRConnector",
                                                "kv_role": "kv_both",
                                                "kv_connector_extra_config": extra})]
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{self.events_port}"}
        super().__init__([
            str(VENV / "bin" / "dynamo-vllm"), "--model", rig.model, "--served-model-name",
            "model", "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32",
            "--enforce-eager", "--max-num-seqs", "4", *PLANES,
            "--kv-events-config", json.dumps(events), *kv, *args],
            rig.workdir / f"{name}.log",
            {**rig.env, "DYN_SYSTEM_PORT": str(self.system_port), **env})

    def wait_id(self, timeout_s: float = 300) -> int:
        """The worker's instance id, once its KV event publisher started."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = _WORKER_ID.search(self.log_path.read_bytes())
            if match:
                self.instance_id = int(match.group(1))
                return self.instance_id
            if not self.alive():
                raise RuntimeError(f"worker {self.name} exited: {self.tail()}")
            time.sleep(0.5)
        raise RuntimeError(f"worker {self.name} not up after {timeout_s} s: {self.tail()}")

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.system_port}/metrics", timeout=10).text

    def kill(self) -> None:
        """SIGKILL to the worker and every process it started (its engine core), by PID:
        a crash, not a shutdown."""
        pids = descendants(self.proc.pid)
        for pid in [self.proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics(), name, **labels)


class DynamoRig:
    """One Dynamo deployment: a discovery store under `workdir`, a frontend, workers."""

    def __init__(self, workdir: Path, model: str, *, pythonpath: str | None = None) -> None:
        self.workdir = workdir
        self.model = model
        src = [str(p) for p in sorted((REPO / "packages").glob("kvcr-*/src"))]
        self.env = {**DYNAMO_ENV, "DYN_FILE_KV": str(workdir / "store"),
                    "PYTHONPATH": pythonpath or os.pathsep.join(src)}
        self.processes: list[Process] = []
        self.port = 0

    def frontend(self, *args: str) -> Process:
        """The frontend with Dynamo's KV router (`args`: more frontend flags)."""
        self.port = low_port()
        proc = Process([str(VENV / "bin" / "python"), "-m", "dynamo.frontend", "--router-mode",
                        "kv", "--http-host", "127.0.0.1", "--http-port", str(self.port), *PLANES,
                        *args],
                       self.workdir / "frontend.log", self.env)
        self.processes.append(proc)
        return proc

    def worker(self, name: str, extra: dict[str, Any] | None,
               env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> Worker:
        """A worker with kvcr (`extra`: its kv_connector_extra_config; None: no connector,
        vanilla vLLM; `args`: more vLLM flags)."""
        worker = Worker(self, name, extra, env or {}, args)
        self.processes.append(worker)
        return worker

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, prompt: str | list[int], *, pin: int | None = None,
                 max_tokens: int = 8, timeout_s: float = 300) -> dict[str, Any]:
        """A greedy completion through the frontend (`pin`: a worker's instance id)."""
        body: dict[str, Any] = {"model": "model", "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0}
        if pin is not None:
            body["nvext"] = {"backend_instance_id": pin}
        reply = httpx.post(f"{self.url}/v1/completions", json=body, timeout=timeout_s)
        reply.raise_for_status()
        result: dict[str, Any] = reply.json()
        return result

    def wait_serving(self, workers: list[Worker], prompt: str, timeout_s: float = 300) -> None:
        """Until a pinned request to each worker is answered (the frontend knows them all)."""
        for worker in workers:
            worker_id = worker.wait_id(timeout_s)
            deadline = time.monotonic() + timeout_s
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    self.complete(prompt, pin=worker_id, max_tokens=1, timeout_s=60)
                    break
                if time.monotonic() > deadline or not worker.alive():
                    raise RuntimeError(f"{worker.name} not served: {worker.tail()}")
                time.sleep(1)

    def clear_kv_blocks(self, worker: Worker) -> str:
        """Dynamo's clear_kv_blocks endpoint of `worker` (vLLM resets its prefix cache and
        its connectors'): what it answered."""
        out = subprocess.run([str(VENV / "bin" / "python"), "-c", _CLEAR,
                              str(worker.instance_id)], env={**os.environ, **self.env},
                             capture_output=True, text=True, timeout=120, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"clear_kv_blocks failed: {out.stderr[-2000:]}")
        return out.stdout.strip()

    def router_metric(self, name: str, **labels: str) -> float:
        return metric(httpx.get(f"{self.url}/metrics", timeout=10).text, name, **labels)

    def stop(self) -> None:
        """Stops every process started here, workers first (by PID)."""
        for proc in reversed(self.processes):
            proc.stop(timeout_s=30)
