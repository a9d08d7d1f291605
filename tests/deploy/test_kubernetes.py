"""The Kubernetes tree (deploy/kubernetes): every overlay renders, validates against the API
schemas of Kubernetes 1.30-1.37 (strict), passes checkov with each skip justified, and has the
shape docs/kubernetes-*.md promise (native sidecar, memory on the guard, probes, security
context, stable peer names, one delivery of the peer secret)."""

from __future__ import annotations

import re
import subprocess

import pytest

pytestmark = pytest.mark.e2e

KUBERNETES_VERSIONS = [f"1.{minor}.0" for minor in range(30, 38)]
SECRET_MOUNT = "/etc/kvcr/peer"
SECRET_NAME = "kvcr-peer-secret"


def test_every_overlay_renders_to_workloads(manifests) -> None:
    """Risk: an overlay that `kubectl kustomize` cannot build (or builds empty) ships."""
    for name in ("vllm-embedded-peers", "vllm-guard", "sglang-hicache", "sglang-linker"):
        assert manifests.workloads(name), name
        assert all(d["metadata"]["namespace"] == "kvcr" for d in manifests.docs[name])
    kinds = {d["kind"] for d in manifests.docs["monitoring"]}
    assert kinds == {"ServiceMonitor", "PrometheusRule"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_strictly_against_the_kubernetes_schemas(manifests, tools,
                                                                     version) -> None:
    """Risk: a misspelt or misplaced field (strict: unknown fields are errors) or a field the
    API of some supported Kubernetes version does not have (native sidecars need 1.29+)."""
    out = subprocess.run([tools.venv("kubernetes-validate"), "--strict", "--quiet",
                          "--no-warn", "-k", version, *map(str, manifests.files.values())],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_checkov_passes_and_every_skip_says_why(manifests, tools, tmp_path) -> None:
    """Risk: a security misconfiguration checkov knows (privileged, root, no probes, host
    namespaces...) ships, or a check is silenced without a reason."""
    for docs in manifests.docs.values():
        for doc in docs:
            for key, value in doc["metadata"].get("annotations", {}).items():
                if key.startswith("checkov.io/skip"):
                    check, _, reason = value.partition("=")
                    assert re.fullmatch(r"CKV2?_K8S_\d+", check), value
                    assert len(reason.split()) >= 8, f"{check}: give the reason, not a token"
    out = subprocess.run([tools.venv("checkov"), "--quiet", "--compact", "--skip-download",
                          "--framework", "kubernetes", "--output", "cli",
                          "-d", str(next(iter(manifests.files.values())).parent)],
                         capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "Passed checks:" in out.stdout and "Failed checks: 0" in out.stdout, out.stdout


def test_every_container_runs_restricted(manifests) -> None:
    """Risk: a container runs as root, can gain privileges, keeps capabilities or writes its
    image; or a pod mounts a service account token or gets Service variables (vLLM reads
    VLLM_PORT, which a Service named vllm would set)."""
    for name in ("vllm-embedded-peers", "vllm-guard", "sglang-hicache", "sglang-linker"):
        for workload in manifests.workloads(name):
            pod = manifests.pod(workload)
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["runAsUser"] == 10001
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            assert pod["automountServiceAccountToken"] is False
            assert pod["enableServiceLinks"] is False
            for c in manifests.containers(workload):
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, c["name"]
                assert sc["readOnlyRootFilesystem"] is True, c["name"]
                assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
                assert {"readinessProbe", "livenessProbe"} <= set(c), c["name"]
                assert "memory" in c["resources"]["limits"], c["name"]


@pytest.mark.parametrize("name", ["vllm-guard", "sglang-hicache", "sglang-linker"])
def test_guard_is_a_native_sidecar_that_pays_for_the_pool(manifests, name) -> None:
    """Risk: the guard starts after the engine (the engine attaches to nothing), stops before
    it, shares a PID namespace with it, or the engines' cgroup is charged for the pool the
    guard's container requests."""
    (workload,) = manifests.workloads(name)
    pod = manifests.pod(workload)
    (guard,) = pod["initContainers"]
    assert guard["name"] == "kvcr-guard" and guard["restartPolicy"] == "Always"
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(guard)
    assert pod["shareProcessNamespace"] is False
    assert "--prefault" in guard["args"] or any(a.startswith("--back-ahead=")
                                                for a in guard["args"])
    requests, limits = guard["resources"]["requests"], guard["resources"]["limits"]
    assert requests["memory"] == limits["memory"]  # shmem pages cannot be reclaimed
    engine = manifests.container(workload, "engine")
    assert "startupProbe" in engine
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    guard_mounts = {m["mountPath"]: m["name"] for m in guard["volumeMounts"]}
    assert mounts["/run/kvcr"] == guard_mounts["/run/kvcr"] == "kvcr-run"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert volumes["kvcr-run"]["emptyDir"]["medium"] == "Memory"
    ports = {p["name"] for s in manifests.find(name, "Service") for p in s["spec"]["ports"]}
    assert "guard-metrics" in ports


def test_embedded_peers_have_stable_names_behind_a_headless_service(manifests) -> None:
    """Risk: peer endpoints that do not resolve (no headless Service, wrong serviceName),
    or a router whose workers are not the StatefulSet's pods."""
    name = "vllm-embedded-peers"
    sts = manifests.one(name, "StatefulSet", "kvcr-vllm")
    service = manifests.one(name, "Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"][
        "labels"].items()
    pods = [f"kvcr-vllm-{i}.{service['metadata']['name']}" for i in range(sts["spec"]["replicas"])]
    engine = manifests.container(sts, "engine")
    config = engine["args"][engine["args"].index("--kv-transfer-config") + 1]
    assert all(f'"tcp://{pod}:7500"' in config for pod in pods), config
    router = manifests.container(manifests.one(name, "Deployment", "kvcr-router"), "router")
    workers = [a for a in router["args"] if a.startswith("--worker=")]
    assert workers == [f"--worker={p.split('.')[0]}=http://{p}:8000,peer=tcp://{p}:7500"
                       for p in pods]


def test_the_peer_secret_comes_from_one_secret_the_same_way_everywhere(manifests) -> None:
    """Risk: one component reads the secret from an environment variable and another from a
    file, or from another Secret or key: a rotation then reaches some of them only."""
    users = 0
    for name in ("vllm-embedded-peers", "vllm-guard", "sglang-hicache", "sglang-linker"):
        for workload in manifests.workloads(name):
            volumes = {v["name"]: v for v in manifests.pod(workload)["volumes"]}
            for c in manifests.containers(workload):
                text = " ".join([*c.get("command", []), *c.get("args", [])])
                assert "KVCR_PEER_SECRET" not in str(c.get("env", [])), c["name"]
                if "peer_secret" not in text and "--peer-secret" not in text:
                    continue
                users += 1
                assert f"{SECRET_MOUNT}/secret" in text, (c["name"], text)
                (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == SECRET_MOUNT]
                assert mount["readOnly"] is True
                assert volumes[mount["name"]]["secret"]["secretName"] == SECRET_NAME
                secret = volumes[mount["name"]]["secret"]
                assert "items" not in secret  # the Secret's key `secret` is the file
                assert secret["defaultMode"] == 0o440  # readable by the pod's fsGroup only
    assert users == 2  # the engines' template and the router


def test_service_monitors_scrape_every_metrics_port_with_the_dashboard_jobs(manifests) -> None:
    """Risk: a ServiceMonitor names a port no Service has, or sets another job than the
    one the dashboard and the alert rules select on."""
    ports: dict[str, set[str]] = {}
    for name in ("vllm-embedded-peers", "vllm-guard", "sglang-hicache", "sglang-linker"):
        for service in manifests.find(name, "Service"):
            component = service["metadata"]["labels"]["app.kubernetes.io/component"]
            ports.setdefault(component, set()).update(p["name"] for p in service["spec"]["ports"])
    jobs = {}
    for monitor in manifests.find("monitoring", "ServiceMonitor"):
        spec = monitor["spec"]
        assert set(spec) == {"selector", "endpoints"}
        component = spec["selector"]["matchLabels"]["app.kubernetes.io/component"]
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "relabelings"}, endpoint
            assert endpoint["port"] in ports[component], endpoint
            (relabel,) = endpoint["relabelings"]
            assert relabel["targetLabel"] == "job"
            jobs[relabel["replacement"]] = endpoint["port"]
    assert jobs == {"kvcr-guard": "guard-metrics", "kvcr-runner": "runner-metrics",
                    "kvcr-engine": "http", "kvcr-router": "http"}
