"""Every dashboard panel's and every alert's PromQL against a real Prometheus (Debian's 2.42,
on loopback) scraping real processes under the jobs the ServiceMonitors set: kvcr-guard
(a kvcr-guard daemon serving peers), kvcr-engine (a vLLM CPU server attached to it, guarded
mode) and kvcr-router (kvcr-router in front of it). Traffic makes the engine store, reload
after its prefix cache is reset, refuse a hint, bypass a request given as prompt embeddings,
and the router strip a client hint (a salted request goes through it too); then each query
must return series, so a misspelt metric or label fails here. An alert's expression is
evaluated with its thresholds made `bool` (the series it watches, firing or not)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")

import httpx
import yaml

from kvcr_bench.processes import GuardProcess, Process
from kvcr_bench.tiny_model import PRESETS
from kvcr_bench.vllm_servers import VllmServer
from kvcr_core.testing import secret_for
from kvcr_core.testing.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deploy" / "monitoring"
TINY_HIDDEN = PRESETS["test"]["hidden_size"]
SECRET = secret_for("deploy-live-peer-secret-0123456789abcdefXYZ")
WORDS = ["pool", "guard", "router", "block", "prefix", "engine", "token", "socket", "peer",
         "hint", "slot", "lease", "commit", "namespace", "metric", "alert", "panel"]
SYSTEM = " ".join(WORDS[(i * 5 + i // 3) % len(WORDS)] + str(i % 89) for i in range(400))
STRANGER_HINT = {"protocol_version": "0.1", "message_id": "deploy-live", "actions": [{
    "action_type": "kv.fetch", "action_version": "1.0",
    "payload": {"source_control_endpoint": "tcp://127.0.0.1:9", "block_hashes": [1, 2, 3]}}]}


def prompt_embeds(tokens: int) -> str:
    """A prompt given as embeddings, as vLLM's completions API takes it (base64 of a saved
    float32 tensor, the tiny model's hidden size)."""
    import base64
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(torch.randn(tokens, TINY_HIDDEN, generator=torch.Generator().manual_seed(3)),
               buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": "model", "max_tokens": 4, "temperature": 0, **extra,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}]}


def wait_http(proc: Process, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.alive(), proc.tail()
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not ready: {proc.tail()}")


def scrape_value(url: str, name: str) -> float:
    text = httpx.get(url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


def signal_of(expr: str) -> str:
    """An alert expression with each comparison to a number made `bool`."""
    return re.sub(r"(==|!=|>=|<=|>|<)\s*(-?\d+(?:\.\d+)?)", r"\1 bool \2", expr)


def queries() -> dict[str, str]:
    """Name -> PromQL of every dashboard target and every alert's signal."""
    out = {}
    board = json.loads((MONITORING / "kvcr-dashboard.json").read_text())
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for group in yaml.safe_load((MONITORING / "kvcr-rules.yaml").read_text())["groups"]:
        for rule in group["rules"]:
            out[f"alert {rule['alert']}"] = signal_of(rule["expr"])
    page = (REPO / "docs" / "monitoring.md").read_text()
    for i, expr in enumerate(re.findall(r"^```promql\n(.*?)\n```", page, re.M | re.S)):
        out[f"docs/monitoring.md query {i + 1}"] = expr
    return out


@pytest.fixture(scope="module")
def stack(tiny_model: str, tools: Any, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[dict[str, Any]]:
    """kvcr-guard, a guarded vLLM server, kvcr-router and Prometheus, all on 127.0.0.1."""
    import os
    import tempfile

    prometheus_bin = tools.system("prometheus")
    work = tmp_path_factory.mktemp("deploy-live")
    sock_dir = tempfile.mkdtemp(prefix="kl", dir="/tmp")
    ports = {name: free_port() for name in ("guard", "peer", "router", "prometheus")}
    dead_peer = f"tcp://127.0.0.1:{free_port()}"  # allowed, never listening
    procs: list[Process] = []
    old_env = {k: os.environ.get(k) for k in ("KVCR_PEER_SECRET", "VLLM_SERVER_DEV_MODE")}
    os.environ.update({"KVCR_PEER_SECRET": SECRET, "VLLM_SERVER_DEV_MODE": "1"})
    try:
        socket_path = f"{sock_dir}/g.sock"
        guard = GuardProcess(Path(sock_dir), "--pool-bytes", "256MiB",
                             "--namespace-pool-bytes", "128MiB", "--back-ahead", "32MiB",
                             "--peer-listen", f"127.0.0.1:{ports['peer']}", "--peer", dead_peer,
                             socket_name="g.sock", metrics_port=ports["guard"])
        procs.append(guard)
        wait_http(guard, f"http://127.0.0.1:{ports['guard']}/metrics", 30)
        engine = VllmServer(tiny_model, work, "engine", {
            "kv_connector": "KVCRConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "kvcr_vllm.connector",
            "kv_connector_extra_config": {"mode": "guarded", "socket": socket_path,
                                          "peers": [dead_peer], "fetch_deadline_s": 1}},
            max_model_len=4096, extra_args=["--enable-prompt-embeds"])
        procs.append(engine)
        engine.wait_ready()
        import torch
        import vllm

        namespace = {"model_id": tiny_model, "dtype": "float32", "kv_dtype": "float32",
                     "block_size_tokens": 32, "num_layers": 4, "num_kv_heads": 2,
                     "head_dim": 64, "layout": f"vllm-{vllm.__version__}/cpu/"
                     f"{torch.backends.cpu.get_cpu_capability()}"}
        router = Process([str(Path(sys.executable).parent / "kvcr-router"), "serve",
                          "--listen", f"127.0.0.1:{ports['router']}",
                          "--worker", f"v={engine.url},peer=tcp://127.0.0.1:{ports['peer']}",
                          "--namespace", json.dumps(namespace), "--tokenizer", tiny_model,
                          "--health-interval-s", "0.5", "--inventory-interval-s", "0.2"],
                         work / "router.log")
        procs.append(router)
        wait_http(router, f"http://127.0.0.1:{ports['router']}/health", 60)
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(MONITORING / "kvcr-rules.yaml")],
                  "scrape_configs": [
                      {"job_name": job, "static_configs": [{"targets": [target]}]}
                      for job, target in (("kvcr-guard", f"127.0.0.1:{ports['guard']}"),
                                          ("kvcr-engine", f"127.0.0.1:{engine.port}"),
                                          ("kvcr-router", f"127.0.0.1:{ports['router']}"))]}
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        prometheus = Process([prometheus_bin, f"--config.file={work / 'prometheus.yml'}",
                              f"--storage.tsdb.path={work / 'tsdb'}",
                              f"--web.listen-address=127.0.0.1:{ports['prometheus']}"],
                             work / "prometheus.log")
        procs.append(prometheus)
        wait_http(prometheus, f"http://127.0.0.1:{ports['prometheus']}/-/ready", 60)
        yield {"engine": engine, "guard": f"http://127.0.0.1:{ports['guard']}/metrics",
               "router": f"http://127.0.0.1:{ports['router']}",
               "prometheus": f"http://127.0.0.1:{ports['prometheus']}", "procs": procs}
    finally:
        for proc in reversed(procs):
            proc.stop()
        for key, value in old_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        subprocess.run(["rm", "-rf", sock_dir], check=False)


def drive(stack: dict[str, Any]) -> None:
    """Traffic that makes every series the dashboard and the alerts watch exist."""
    engine, router = stack["engine"], stack["router"]
    with httpx.Client(timeout=300) as http:
        first = http.post(f"{router}/v1/chat/completions", json=chat("What is a pool?"))
        assert first.status_code == 200, first.text
        deadline = time.monotonic() + 60  # saves commit after the step that completed them
        while scrape_value(stack["guard"], "kvcr_blocks_stored_total") < 20:
            assert time.monotonic() < deadline, "the engine stored nothing in kvcr-guard"
            time.sleep(0.2)
        reset = http.post(f"{engine.url}/reset_prefix_cache")
        assert reset.status_code == 200, reset.text
        again = http.post(f"{router}/v1/chat/completions", json=chat("What is a pool?"))
        assert again.status_code == 200, again.text
        assert engine.metric("vllm:kvcr_loaded_tokens_total") >= 20 * 32  # from the guard
        refused = http.post(f"{engine.url}/v1/completions", json={
            "model": "model", "prompt": "a hint naming a stranger", "max_tokens": 2,
            "kv_transfer_params": {"kv_hint": STRANGER_HINT}})
        assert refused.status_code == 200, refused.text
        salted = http.post(f"{router}/v1/chat/completions",
                           json=chat("salted", cache_salt="tenant-a"))
        assert salted.status_code == 200, salted.text
        embedded = http.post(f"{engine.url}/v1/completions", json={
            "model": "model", "max_tokens": 2, "prompt_embeds": prompt_embeds(40)})
        assert embedded.status_code == 200, embedded.text  # bypassed: kvcr cannot key it
        stripped = http.post(f"{router}/v1/chat/completions",
                             json=chat("hinted", kv_hint=STRANGER_HINT))
        assert stripped.status_code == 200, stripped.text
    assert engine.metric("vllm:kvcr_failures_total") >= 1
    assert engine.metric("vllm:kvcr_bypassed_requests_total") >= 1


def test_every_panel_and_alert_query_returns_series(stack) -> None:
    """Risk: a panel or an alert watches a metric or label that no kvcr process exports
    (a typo, a renamed metric, a label that does not exist), so it shows nothing or never
    fires; or Prometheus refuses the rules file."""
    drive(stack)
    api = f"{stack['prometheus']}/api/v1"
    todo = queries()
    assert len(todo) >= 40
    empty: dict[str, str] = {}
    deadline = time.monotonic() + 90  # counters born by the traffic need two scrapes
    while True:
        empty = {}
        for name, expr in todo.items():
            answer = httpx.get(f"{api}/query", params={"query": expr}, timeout=30).json()
            assert answer["status"] == "success", (name, expr, answer)
            if not answer["data"]["result"]:
                empty[name] = expr
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not empty, "queries without series:\n" + "\n".join(
        f"{name}: {expr}" for name, expr in empty.items())
    rules = httpx.get(f"{api}/rules", timeout=30).json()["data"]["groups"]
    loaded = {r["name"]: r for g in rules for r in g["rules"]}
    assert set(loaded) == {n.removeprefix("alert ") for n in todo if n.startswith("alert ")}
    assert all(r["health"] != "err" for r in loaded.values()), loaded
    targets = httpx.get(f"{api}/targets", timeout=30).json()["data"]["activeTargets"]
    assert {t["labels"]["job"]: t["health"] for t in targets} == {
        "kvcr-guard": "up", "kvcr-engine": "up", "kvcr-router": "up"}
