"""The rendered pods of overlays vllm-embedded-peers and vllm-guard run as processes on this
machine (kvcr_bench.pods): each pod in its own network namespace, as its node, with the
manifests' command lines, environment, users, Secret, ConfigMap and emptyDir mounts, probes and
restart policies. This is not a cluster (no images, scheduler or kubelet); it proves that the
commands, flags, mounts, users and peer names of the manifests work together.

What is changed for this machine, and only this (`on_this_machine`): the tiny local model
stands in for the real one (bound at the manifests' model path; the router's namespace file
gets its KV shape), pools of 16GiB become 256MiB, and the engines get vLLM's CPU flags
(float32, eager, a short context, blocks of 32 tokens) and CPU environment."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvcr_bench.pods import Pod, PodNetwork, Sources, environment_path, workload_pods
from kvcr_bench.vllm_servers import CPU_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(os.geteuid() != 0 or not all(
                  shutil.which(t) for t in ("ip", "unshare", "nsenter")),
                  reason="pods as processes need root, iproute2 and util-linux; CI runs as "
                         "root")]

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]  # the checkout: the environment the pods use
MODEL_CLAIM = "kvcr-models"
CLUSTER_NAMESPACE = "kvcr"
WORDS = ["def", "class", "return", "import", "lambda", "yield", "async", "await", "value",
         "index", "buffer", "socket", "thread", "namespace", "router", "worker", "block"]
CPU_BLOCK = 32  # vLLM's CPU attention takes multiples of 32 tokens (the manifests: 16)
SYSTEM = " ".join(WORDS[(i * 7 + i // 5) % len(WORDS)] + str(i % 97) for i in range(300))


def on_this_machine(container: str, argv: list[str], env: dict[str, str]
                    ) -> tuple[list[str], dict[str, str]]:
    """The only changes to the manifests' containers (see the module header)."""
    argv = [arg.replace("16GiB", "256MiB") for arg in argv]
    if argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]:
        argv = [f"--block-size={CPU_BLOCK}" if a.startswith("--block-size=") else a
                for a in argv]
        argv += ["--dtype=float32", "--max-model-len=2048", "--enforce-eager",
                 "--max-num-seqs=4"]
        env = {**env, **CPU_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    return argv, env


def model_folder(tmp_path: Path, tiny_model: str, model_arg: str) -> Path:
    """The PersistentVolumeClaim's content: the tiny model where the manifests expect theirs."""
    claim = tmp_path / "models"
    claim.mkdir()
    (claim / Path(model_arg).relative_to("/models")).symlink_to(tiny_model)
    return claim


def tiny_namespace(manifest_namespace: dict[str, Any], tiny_model: str) -> dict[str, Any]:
    """The router's namespace file with the tiny model's KV shape and the CPU block size, as
    the connector derives them (model id and TP fields stay the manifest's, so they are
    checked)."""
    from vllm.engine.arg_utils import EngineArgs

    from kvcr_vllm.settings import namespace_for

    config = EngineArgs(model=tiny_model, dtype="float32", max_model_len=2048,
                        block_size=CPU_BLOCK,
                        enforce_eager=True).create_engine_config()
    shape = dataclasses.asdict(namespace_for(config, 0))
    keys = ("dtype", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "layout",
            "block_size_tokens")
    return {**manifest_namespace, **{k: shape[k] for k in keys}}


def generated_secret(tmp_path: Path) -> bytes:
    """The peer secret made as docs/kubernetes-vllm.md says (`kvcr secret generate`)."""
    out = tmp_path / "peer-secret"
    subprocess.run([str(BIN / "kvcr"), "secret", "generate", "--out", str(out)], check=True,
                   timeout=60)
    return out.read_bytes()


def dns_names(docs: list[dict[str, Any]], pods: dict[str, Pod]) -> dict[str, str]:
    """What cluster DNS would answer: StatefulSet pods by `<pod>.<service>`, Services by
    name (to their first pod), short and fully qualified."""
    names: dict[str, str] = {}
    for doc in docs:
        if doc["kind"] == "StatefulSet":
            service = doc["spec"]["serviceName"]
            for pod_name, _ in workload_pods(doc):
                names[f"{pod_name}.{service}"] = pods[pod_name].address
        if doc["kind"] == "Service":
            selector = doc["spec"].get("selector", {})
            matching = [pod for pod in pods.values()
                        if selector.items() <= pod.labels.items()]
            if matching:
                names[doc["metadata"]["name"]] = matching[0].address
    suffix = f".{CLUSTER_NAMESPACE}.svc.cluster.local"
    return {**names, **{f"{name}{suffix}": address for name, address in names.items()}}


def make_pods(docs: list[dict[str, Any]], network: PodNetwork, tmp_path: Path,
              sources: Sources) -> dict[str, Pod]:
    pods: dict[str, Pod] = {}
    for workload in (d for d in docs if d["kind"] in ("StatefulSet", "Deployment")):
        labels = workload["spec"]["template"]["metadata"].get("labels", {})
        for pod_name, spec in workload_pods(workload):
            pod = Pod(pod_name, spec, network, tmp_path, sources, environment_path(BIN),
                      on_this_machine, keep=REPO)
            pod.labels = labels
            pods[pod_name] = pod
    names = dns_names(docs, pods)
    for pod in pods.values():
        pod.hosts(names)
    return pods


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a sample over the label sets that include `labels` (0 if absent)."""
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def scrape(url: str, name: str, **labels: str) -> float:
    return metric(httpx.get(url, timeout=10).text, name, **labels)


def eventually(url: str, name: str, above: float, timeout_s: float = 60,
               **labels: str) -> float:
    """The sample once it exceeds `above` (counters and feeds settle a moment after a
    request), or its last value after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (value := scrape(url, name, **labels)) <= above and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def chat(url: str, question: str) -> dict[str, Any]:
    body = {"model": "llama-3.1-8b-instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}]}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


@pytest.fixture
def overlay(manifests, tiny_model: str, tmp_path: Path) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    """Starts every pod of an overlay (`start(name, tag, subnet)`), closes them at the end."""
    opened: list[Pod] = []
    stack: list[PodNetwork] = []

    def start(name: str, tag: str, subnet: int) -> dict[str, Pod]:
        docs = manifests.docs[name]
        engine = next(c for w in manifests.workloads(name)
                      for c in manifests.containers(w) if c["name"] == "engine")
        model_arg = next(a.split("=", 1)[1] for a in engine["args"] if a.startswith("--model="))
        config_maps = {d["metadata"]["name"]: dict(d.get("data", {}))
                       for d in docs if d["kind"] == "ConfigMap"}
        for data in config_maps.values():
            if "namespace.json" in data:
                data["namespace.json"] = json.dumps(
                    tiny_namespace(json.loads(data["namespace.json"]), tiny_model))
        sources = Sources(claims={MODEL_CLAIM: model_folder(tmp_path, tiny_model, model_arg)},
                          secrets={"kvcr-peer-secret": {"secret": generated_secret(tmp_path)}},
                          config_maps=config_maps)
        network = PodNetwork(tag, subnet).__enter__()
        stack.append(network)
        pods = make_pods(docs, network, tmp_path, sources)
        opened.extend(pods.values())
        return pods

    try:
        yield start
    finally:
        for pod in opened:
            pod.close()
        for network in stack:
            network.__exit__(None, None, None)


def test_embedded_peers_overlay_reuses_a_prompt_on_the_other_node(overlay) -> None:
    """Risk: the StatefulSet's peer names, peer secret mount, ports or the router's worker
    flags do not agree, so the pods run but no KV ever crosses nodes (a silent loss of the
    overlay's whole point) or the router cannot reach its workers."""
    pods = overlay("vllm-embedded-peers", "mr", 1)
    engines = [pods["kvcr-vllm-0"], pods["kvcr-vllm-1"]]
    router = pods["kvcr-router-0"]
    for pod in engines:
        pod.start()
    for pod in engines:
        pod.wait_ready()
    router.start().wait_ready(120)
    first = chat(f"http://{router.address}:8000", "What is a peer?")
    prompt_tokens = first["usage"]["prompt_tokens"]
    urls = {p.name: f"http://{p.address}:8000/metrics" for p in engines}
    deadline = time.monotonic() + 60
    while not any(scrape(url, "vllm:kvcr_stored_blocks_total") for url in urls.values()):
        assert time.monotonic() < deadline, [p.logs("engine") for p in engines]
        time.sleep(0.5)
    stored = {name: scrape(url, "vllm:kvcr_stored_blocks_total") for name, url in urls.items()}
    served = [p for p in engines if stored[p.name] > 0]
    assert len(served) == 1, stored
    node1, node2 = served[0], next(p for p in engines if p is not served[0])
    saved = stored[node1.name]
    assert saved >= prompt_tokens // CPU_BLOCK - 1, stored
    feed = f"http://{node2.address}:9750/metrics"  # node 2's runner metrics (metrics_listen)
    assert eventually(feed, "kvcr_peer_feed_blocks", saved - 1,
                      peer=f"tcp://{node1.name}.kvcr-vllm:7500") >= saved
    second = chat(f"http://{node2.address}:8000", "What is a peer?")
    reused = second["kv_transfer_params"]["kvcr_loaded_tokens"]
    print(f"\nnode 2 reused {reused} of {prompt_tokens} prompt tokens from node 1")
    assert reused >= (saved - 1) * CPU_BLOCK, second["kv_transfer_params"]
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    assert scrape(feed, "kvcr_pull_lookups_total", outcome="remote_run") >= 1
    assert scrape(f"http://{node2.address}:8000/metrics",
                  "vllm:kvcr_pulled_blocks_total") >= saved - 1


def test_guard_sidecar_overlay_brings_a_killed_engine_back_warm(overlay) -> None:
    """Risk: the sidecar's socket, shared mount, allowed uid or probes do not match the
    engine's, so the engine runs without the guard (or never starts), and a crashed engine
    comes back cold although the guard kept its blocks."""
    (pod,) = overlay("vllm-guard", "mg", 2).values()
    pod.start()
    pod.wait_ready()
    first = chat(f"http://{pod.address}:8000", "What is a guard?")
    assert first["kv_transfer_params"]["kvcr_loaded_tokens"] == 0
    saved = first["kv_transfer_params"]["kvcr_saved_blocks"]
    assert saved >= first["usage"]["prompt_tokens"] // CPU_BLOCK - 1
    guard = pod.container("kvcr-guard")
    assert guard.proc is not None
    guard_pid = guard.proc.pid
    pod.kill("engine")  # the pod's restartPolicy (Always) brings it back
    started = time.monotonic()
    pod.wait_ready()
    back_s = time.monotonic() - started
    again = chat(f"http://{pod.address}:8000", "What is a guard?")
    warm = again["kv_transfer_params"]["kvcr_loaded_tokens"]
    print(f"\nengine restarted in {back_s:.0f} s; loaded {warm} of "
          f"{again['usage']['prompt_tokens']} prompt tokens from the guard")
    assert pod.container("engine").restarts == 1 and guard.restarts == 0
    assert guard.proc.pid == guard_pid
    assert warm >= (saved - 1) * CPU_BLOCK, again["kv_transfer_params"]
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    metrics = f"http://{pod.address}:9750/metrics"
    assert scrape(metrics, "kvcr_guard_clients") >= 1
