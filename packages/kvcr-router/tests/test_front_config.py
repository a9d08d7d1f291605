"""`kvcr-router` configuration and command line: worker specs, file + flags, clear errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcr_core.errors import ConfigError
from kvcr_core.keys import NamespaceSpec
from kvcr_router.cli import build_parser, config_from_args, main
from kvcr_router.config import RouterConfig, WorkerSpec
from kvcr_router.cost import CostWeights

NS = {"model_id": "m", "dtype": "float32", "kv_dtype": "float32", "block_size_tokens": 32,
      "num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "layout": "vllm-0.32.0/cpu/AVX2"}


@pytest.mark.unit
def test_worker_flag_parses_endpoints_canonically() -> None:
    """NAME=URL,peer=..,kv_events=.. (dash or underscore) gives canonical endpoints."""
    w = WorkerSpec.parse("a=http://10.0.0.1:8000/,peer=tcp://10.0.0.1:7500,"
                         "kv-events=tcp://localhost:5557")
    assert w == WorkerSpec("a", "http://10.0.0.1:8000", "tcp://10.0.0.1:7500",
                           "tcp://localhost:5557")
    assert WorkerSpec.parse("b=https://h:1").peer is None


@pytest.mark.unit
@pytest.mark.parametrize(("text", "field"), [
    ("Bad Name=http://h:1", "worker.name"),
    ("a=ftp://h:1", "worker a.url"),
    ("a=http://h:1/v1", "worker a.url"),
    ("a=http://h:1,peer=h:7", "worker a.peer"),
    ("a=http://h:1,color=red", "worker a"),
    ("http://h:1", "worker"),
])
def test_bad_worker_flags_name_the_field(text: str, field: str) -> None:
    """Each mistake in a --worker flag is a ConfigError naming what to fix."""
    with pytest.raises(ConfigError) as err:
        WorkerSpec.parse(text)
    assert err.value.field == field


@pytest.mark.unit
def test_file_and_flags_merge_with_flags_winning(tmp_path: Path) -> None:
    """A YAML file gives workers, namespace and weights; command-line flags override."""
    config = tmp_path / "router.yaml"
    config.write_text(json.dumps({
        "listen": "0.0.0.0:9000", "namespace": NS, "fetch-w": 0.25, "pool_w": 0.5,
        "workers": [{"name": "a", "url": "http://h:1", "peer": "tcp://h:2"}, "b=http://h:3"]}))
    args = build_parser().parse_args(["serve", "--config", str(config), "--fetch-w", "0.4",
                                      "--health-interval-s", "9"])
    cfg = config_from_args(args)
    assert (cfg.listen_host, cfg.listen_port) == ("0.0.0.0", 9000)
    assert [w.name for w in cfg.workers] == ["a", "b"] and cfg.workers[0].peer == "tcp://h:2"
    assert cfg.weights == CostWeights(fetch_w=0.4, pool_w=0.5)
    assert cfg.health_interval_s == 9 and cfg.inventory_interval_s == 0.25
    assert cfg.namespace_digest == NamespaceSpec.from_mapping(NS).digest()
    assert cfg.block_size == 32


@pytest.mark.unit
def test_weights_preset_tuned_is_the_simulator_recommendation_and_flags_adjust_it() -> None:
    """Risk: the documented `--weights-preset tuned` does not give the weights the simulator
    benchmark measured, or a flag next to it is ignored."""
    from kvcr_router.simulate.sweep import TUNED_WEIGHTS

    args = build_parser().parse_args(["serve", "--namespace", json.dumps(NS), "--worker",
                                      "a=http://h:1", "--weights-preset", "tuned",
                                      "--min-fetch-blocks", "8"])
    cfg = config_from_args(args)
    assert cfg.weights == dataclasses.replace(TUNED_WEIGHTS, min_fetch_blocks=8)
    plain = config_from_args(build_parser().parse_args(
        ["serve", "--namespace", json.dumps(NS), "--worker", "a=http://h:1"]))
    assert plain.weights == CostWeights()


@pytest.mark.unit
@pytest.mark.parametrize(("data", "field"), [
    ({"workers": ["a=http://h:1"]}, "namespace"),
    ({"workers": ["a=http://h:1"], "namespace_digest": "00" * 16}, "block_size"),
    ({"workers": ["a=http://h:1"], "namespace_digest": "zz"}, "namespace_digest"),
    ({"workers": [], "namespace": NS}, "workers"),
    ({"workers": ["a=http://h:1", "a=http://h:2"], "namespace": NS}, "workers"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "block_size": 16}, "block_size"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "fetch_w": -1}, "fetch_w"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "read_timeout_s": 0}, "read_timeout_s"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "colour": 1}, "colour"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "weights_preset": "best"},
     "weights_preset"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "tokenize_threads": 0}, "tokenize_threads"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "tokenize_threads": 65},
     "tokenize_threads"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "tokenize_timeout_s": 0},
     "tokenize_timeout_s"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "max_pending_tokenize": 0},
     "max_pending_tokenize"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "max_prompt_chars": -1},
     "max_prompt_chars"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "trust_request_chat_template": "no"},
     "trust_request_chat_template"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "expose_cache_details": 1},
     "expose_cache_details"),
    ({"workers": ["a=http://h:1"], "namespace": NS, "operator_token_env": ""},
     "operator_token_env"),
])
def test_bad_settings_name_the_field(data: dict, field: str) -> None:
    """Missing namespace, contradicting block size, duplicate names, bad weights, timeouts
    or tokenizing bounds, non-boolean switches and unknown keys all fail at start-up,
    naming the field."""
    with pytest.raises(ConfigError) as err:
        RouterConfig.from_mapping(data)
    assert err.value.field == field


@pytest.mark.unit
def test_trust_flags_default_closed_and_reach_the_config(tmp_path: Path) -> None:
    """Risk: a hardening default is open, or a trust flag or file setting is lost. By default
    request templates are not rendered and cache details are not exposed; the flags switch
    them on, a config file may too, and the pending bound follows the thread count."""
    base = ["serve", "--namespace", json.dumps(NS), "--worker", "a=http://h:1"]
    plain = config_from_args(build_parser().parse_args(base))
    assert not plain.trust_request_chat_template and not plain.expose_cache_details
    assert (plain.tokenize_threads, plain.tokenize_pending_bound, plain.tokenize_timeout_s,
            plain.operator_token_file) == (2, 8, 1.0, None)
    cfg = config_from_args(build_parser().parse_args([
        *base, "--trust-request-chat-template", "--expose-cache-details", "--tokenize-threads",
        "3", "--tokenize-timeout-s", "0.25", "--max-prompt-chars", "1000",
        "--operator-token-file", "/run/token", "--operator-token-env", "OPS_TOKEN"]))
    assert cfg.trust_request_chat_template and cfg.expose_cache_details
    assert (cfg.tokenize_threads, cfg.tokenize_pending_bound, cfg.tokenize_timeout_s,
            cfg.max_prompt_chars) == (3, 12, 0.25, 1000)
    assert (cfg.operator_token_file, cfg.operator_token_env) == ("/run/token", "OPS_TOKEN")
    config = tmp_path / "router.yaml"
    config.write_text(json.dumps({"trust-request-chat-template": True,
                                  "max_pending_tokenize": 5}))
    filed = config_from_args(build_parser().parse_args([*base, "--config", str(config)]))
    assert filed.trust_request_chat_template and filed.tokenize_pending_bound == 5


@pytest.mark.unit
def test_cli_reports_config_errors_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad flag exits 2 with the field and the fix; a peer endpoint without the peer
    secret too, and an unreadable operator token file; --version prints the version."""
    assert main(["serve", "--worker", "a=ftp://h:1", "--namespace", json.dumps(NS)]) == 2
    assert "worker a.url" in capsys.readouterr().err
    assert main(["serve", "--worker", "a=http://h:1,peer=tcp://h:2", "--namespace",
                 json.dumps(NS), "--peer-secret-env", "KVCR_TEST_NO_SUCH_SECRET"]) == 2
    assert "KVCR_TEST_NO_SUCH_SECRET" in capsys.readouterr().err
    assert main(["serve", "--worker", "a=http://h:1", "--namespace", json.dumps(NS),
                 "--operator-token-file", "/nonexistent/kvcr-operator-token"]) == 2
    assert "operator_token_file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("kvcr-router 0.1")


@pytest.mark.integration
def test_console_script_dispatches_simulate() -> None:
    """`kvcr-router simulate` reaches the simulator's own command line."""
    exe = Path(sys.executable).parent / "kvcr-router"
    out = subprocess.run([str(exe), "simulate", "--help"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0 and "--requests" in out.stdout, out.stderr


@pytest.mark.unit
def test_shipped_example_config_is_valid() -> None:
    """examples/router.yaml (referenced by docs/router.md) loads as written."""
    example = Path(__file__).resolve().parents[3] / "examples" / "router.yaml"
    cfg = config_from_args(build_parser().parse_args(["serve", "--config", str(example)]))
    assert [w.kv_events for w in cfg.workers] == ["tcp://10.0.0.1:5557", "tcp://10.0.0.2:5557"]
    assert cfg.weights == CostWeights() and cfg.block_size == 16


@pytest.mark.integration
def test_a_served_router_exports_process_and_build_info() -> None:
    """Risk: the router's /metrics says nothing of the process (memory, CPU, open files) or
    the version running, so it cannot be alerted on like the rest of the fleet."""
    import socket
    import time
    import urllib.error
    import urllib.request

    from kvcr_router._version import __version__

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcr_router", "serve", "--listen", f"127.0.0.1:{port}",
         "--worker", "a=http://127.0.0.1:9", "--namespace-digest", "ab" * 16,
         "--block-size", "16"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                              timeout=5).read().decode()
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
                time.sleep(0.2)
        assert f'kvcr_build_info{{component="kvcr-router",version="{__version__}"}} 1.0' in text
        assert "process_resident_memory_bytes" in text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
