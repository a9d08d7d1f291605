"""The `kvcr-*` commands, flags, engine flags, kvcr configs and environment variables in the
rendered manifests are the real ones: each container's command line goes through the real
argument parser and config loader of what it runs (kvcr-guard, kvcr-router, `kvcr status`,
vLLM's server + kvcr-vllm's settings, SGLang's server + kvcr-sglang's settings), inside a
stand-in of the pod's file system: ConfigMaps and a generated strong peer secret written where
their volumes mount, emptyDirs as directories, `$(VAR)` expanded as the kubelet does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcr_core.cli.secret_cmd import generate_secret
from kvcr_core.keys import NamespaceSpec
from kvcr_core.testing.setup import missing_setup

pytestmark = pytest.mark.e2e

SGLANG_HELPER = Path(__file__).with_name("sglang_cmdline.py")
GIB = 2**30


class PodFiles:
    """One pod's volumes laid out under a short temporary directory (Unix socket paths must
    stay under 107 bytes). `local(text)` is a path or command line as this stand-in sees it:
    the pod's mount paths moved under the root (also inside ConfigMap files and JSON
    arguments); `argv(container)` also expands `$(VAR)` from the container's env."""

    def __init__(self, root: Path, workload: dict[str, Any], docs: list[dict[str, Any]]):
        self.config_maps = {d["metadata"]["name"]: d.get("data", {})
                            for d in docs if d["kind"] == "ConfigMap"}
        self.secret = generate_secret()
        spec = workload["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        self.mounts: dict[str, Path] = {}
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            for m in c.get("volumeMounts", []):
                path = root / m["name"]
                assert self.mounts.setdefault(m["mountPath"], path) == path, m
        longest_first = sorted(self.mounts, key=len, reverse=True)
        self._mount_re = re.compile("(" + "|".join(map(re.escape, longest_first)) + r')(?=/|"|$)')
        for path in set(self.mounts.values()):
            path.mkdir()
            volume = volumes[path.name]
            if "configMap" in volume:
                for key, text in self.config_maps[volume["configMap"]["name"]].items():
                    (path / key).write_text(self.local(text))
            if "secret" in volume:  # as `kvcr secret generate --out` writes it
                (path / "secret").write_text(self.secret + "\n")

    def local(self, text: str) -> str:
        """In one pass: a moved path is never moved again."""
        return self._mount_re.sub(lambda m: str(self.mounts[m.group(1)]), text)

    def in_pod(self, text: str) -> str:
        """The inverse of `local`: the path as the pod sees it."""
        for mount_path, path in self.mounts.items():
            text = text.replace(str(path), mount_path)
        return text

    def argv(self, c: dict[str, Any]) -> list[str]:
        env = {}
        for var in c.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
            else:
                ref = var["valueFrom"]["configMapKeyRef"]
                env[var["name"]] = self.config_maps[ref["name"]][ref["key"]]
        return [self.local(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a))
                for a in [*c.get("command", []), *c.get("args", [])]]


@pytest.fixture
def pod_files() -> Iterator[Any]:
    with tempfile.TemporaryDirectory(prefix="kd", dir="/tmp") as root:
        made = 0

        def make(workload: dict[str, Any], docs: list[dict[str, Any]]) -> PodFiles:
            nonlocal made
            made += 1
            path = Path(root) / str(made)
            path.mkdir()
            return PodFiles(path, workload, docs)

        yield make


def _gib(quantity: str) -> float:
    assert quantity.endswith("Gi"), quantity
    return float(quantity[:-2])


def _port(c: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return int(port)


def parse_guard(argv: list[str]) -> Any:
    from kvcr_guard.cli import build_parser, config_from_args

    assert argv[0] == "kvcr-guard"
    return config_from_args(build_parser().parse_args(argv[1:]))


def parse_kvcr_status(argv: list[str]) -> str:
    from kvcr_core.cli.main import _build_parser

    assert argv[0] == "kvcr"
    args = _build_parser().parse_args(argv[1:])
    assert args.command == "status"
    return str(args.socket)


def parse_vllm(argv: list[str]) -> tuple[Any, Any]:
    import importlib

    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvcr_vllm.settings import ConnectorSettings

    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"], argv
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    validate_parsed_serve_args(args)
    kv = args.kv_transfer_config
    assert (kv.kv_connector, kv.kv_role) == ("KVCRConnector", "kv_both")
    module = importlib.import_module(kv.kv_connector_module_path)
    assert hasattr(module, kv.kv_connector)
    return args, ConnectorSettings.from_extra_config(kv.kv_connector_extra_config,
                                                     engine_id="deploy-test")


def parse_router(argv: list[str]) -> Any:
    from kvcr_core.peers import PeerSecret
    from kvcr_router.cli import build_parser, config_from_args

    assert argv[:2] == ["kvcr-router", "serve"]
    config = config_from_args(build_parser().parse_args(argv[1:]))
    assert config.peer_secret_file is not None
    PeerSecret.from_file(config.peer_secret_file)  # present and strong
    return config


def sglang_python(repo: Path) -> str:
    python = repo / ".venv-sglang" / "bin" / "python"
    if not python.exists():
        missing_setup(".venv-sglang is missing: run bash scripts/setup_sglang.sh")
    return str(python)


def parse_sglang(repo: Path, argv: list[str]) -> dict[str, Any]:
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"], argv
    out = subprocess.run([sglang_python(repo), str(SGLANG_HELPER), *argv[3:]],
                         capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": str(
                             repo / ".cache" / "torch_extensions")})
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def check_guard(manifests, workload: dict[str, Any], files: PodFiles) -> Any:
    """The guard sidecar's flags, probes and resources; returns its parsed config."""
    guard_c = manifests.container(workload, "kvcr-guard")
    config = parse_guard(files.argv(guard_c))
    server = config.server
    pod = manifests.pod(workload)
    assert server.allowed_uids == frozenset({pod["securityContext"]["runAsUser"]})
    assert server.back_ahead_bytes and server.namespace_idle_s is None  # backed in the guard
    assert (config.metrics_host, config.metrics_port) == ("0.0.0.0",
                                                          _port(guard_c, "guard-metrics"))
    pool_gib = server.runner.pool_bytes / GIB
    assert server.runner.namespace_pool_bytes == server.runner.pool_bytes  # TP 1: one namespace
    limit = _gib(guard_c["resources"]["limits"]["memory"])
    assert pool_gib + 0.5 <= limit <= pool_gib + 2, "the guard's memory = its pool + overhead"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert parse_kvcr_status(files.argv(
            {**guard_c, "args": guard_c[probe]["exec"]["command"][1:],
             "command": guard_c[probe]["exec"]["command"][:1]})) == server.socket_path
    return config


def test_vllm_embedded_peers_and_router_command_lines_parse(manifests, pod_files) -> None:
    """Risk: a flag, a kv_connector_extra_config key, a secret path or a router worker spec
    that the real code refuses (or reads differently) ships in overlay (a)."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    import vllm

    name = "vllm-embedded-peers"
    docs = manifests.docs[name]
    sts = manifests.one(name, "StatefulSet", "kvcr-vllm")
    engine_c = manifests.container(sts, "engine")
    engine_files = pod_files(sts, docs)
    args, settings = parse_vllm(engine_files.argv(engine_c))
    assert settings.mode.value == "embedded"
    assert settings.peer.secret is not None  # read from the mounted Secret
    assert settings.peer.listen == f"0.0.0.0:{_port(engine_c, 'kvcr-peer')}"
    assert args.port == _port(engine_c, "http")
    limit = _gib(engine_c["resources"]["limits"]["memory"])
    assert limit >= settings.runner.pool_bytes / GIB + 16, "the embedded pool is the engine's"

    router_d = manifests.one(name, "Deployment", "kvcr-router")
    router_files = pod_files(router_d, docs)
    router = parse_router(router_files.argv(manifests.container(router_d, "router")))
    assert {w.peer for w in router.workers} == set(settings.peer.peers)
    # The router's namespace is the engines': model_id is --model exactly as vLLM gets it,
    # the same block size and vLLM version; it tokenizes with the served model's tokenizer.
    raw = manifests.find(name, "ConfigMap")[0]["data"]["namespace.json"]
    spec = NamespaceSpec.from_mapping(json.loads(raw))
    assert router.namespace_digest == NamespaceSpec.from_mapping(
        json.loads(router_files.local(raw))).digest()
    model = engine_files.in_pod(args.model)
    assert (spec.model_id, spec.block_size_tokens) == (model, args.block_size)
    assert router_files.in_pod(router.tokenizer or "") == model
    minor = ".".join(vllm.__version__.split(".")[:2])
    assert re.fullmatch(rf"vllm-{re.escape(minor)}\.\d+/cuda", spec.layout), spec.layout
    image = engine_c["image"]
    assert image.startswith("kvcr-vllm:")


def test_vllm_guard_command_lines_parse_and_meet_on_one_socket(manifests, pod_files) -> None:
    """Risk: the engine and its kvcr-guard sidecar disagree on the socket or the uid, a guard
    flag does not exist, or the guard's memory does not cover the pool it backs."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    name = "vllm-guard"
    (workload,) = manifests.workloads(name)
    files = pod_files(workload, manifests.docs[name])
    guard = check_guard(manifests, workload, files)
    _, settings = parse_vllm(files.argv(manifests.container(workload, "engine")))
    assert settings.mode.value == "guarded"
    assert settings.socket == guard.server.socket_path
    assert not settings.peer.active


@pytest.mark.parametrize(("name", "way"), [("sglang-hicache", "backend"),
                                           ("sglang-linker", "linker")])
def test_sglang_command_lines_parse_through_sglang_and_kvcr_sglang(manifests, pod_files,
                                                                   tools, name, way) -> None:
    """Risk: an SGLang flag, the backend config in the ConfigMap (file for HiCache, a $(VAR)
    for the linker) or a kvcr key in it that SGLang or kvcr-sglang refuses at start."""
    (workload,) = manifests.workloads(name)
    files = pod_files(workload, manifests.docs[name])
    guard = check_guard(manifests, workload, files)
    engine_c = manifests.container(workload, "engine")
    parsed = parse_sglang(tools.repo, files.argv(engine_c))
    assert way in parsed
    assert parsed["module"] in ("kvcr_sglang.hicache", "kvcr_sglang.linker")
    assert (parsed["mode"], parsed["socket"]) == ("guarded", guard.server.socket_path)
    assert parsed["port"] == _port(engine_c, "http")
    assert parsed["page_size"] == 64


def test_a_wrong_or_shortened_flag_is_caught(manifests, pod_files) -> None:
    """Risk: the parsing above accepts anything (a check that cannot fail), or a shortened
    flag (argparse's abbreviations) passes here and means something else after an upgrade."""
    (workload,) = manifests.workloads("vllm-guard")
    files = pod_files(workload, manifests.docs["vllm-guard"])
    argv = files.argv(manifests.container(workload, "kvcr-guard"))
    for wrong in ("--pool-size=1GiB", "--namespace-pool-byte=1GiB"):
        with pytest.raises(SystemExit):
            parse_guard([*argv, wrong])
    router_d = manifests.one("vllm-embedded-peers", "Deployment", "kvcr-router")
    router_argv = pod_files(router_d, manifests.docs["vllm-embedded-peers"]).argv(
        manifests.container(router_d, "router"))
    with pytest.raises(SystemExit):
        parse_router([*router_argv, "--tokenize-thread=4"])
