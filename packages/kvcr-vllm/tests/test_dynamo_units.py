"""What NVIDIA Dynamo needs of the connector, without Dynamo: its `secondary_tiers`
capability config, hints read from vLLM's own `Request.kv_hints` (a real KvHintsEnvelope) as
well as from kv_transfer_params, and the `vllm-engine` hint hash scheme matched against block
hashes vLLM itself computes (real vLLM Requests and hashers, two hash settings). The
scheduler runs on kvcr_core.testing's in-process Runners; tests/dynamo drives real Dynamo."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import pytest

pytest.importorskip("vllm", reason="the scheduler side and the hint types are vLLM's")

from prometheus_client import CollectorRegistry
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.request import Request

from kvcr_core.config import KVCRConfig
from kvcr_core.errors import ConfigError
from kvcr_core.keys import NamespaceSpec, block_keys, router_hash_kvcr_v1
from kvcr_core.runner import Runner
from kvcr_core.testing import (
    LoopbackPeers,
    ManualClock,
    ObservedRunner,
    in_process,
    pattern_block,
    secret_for,
)
from kvcr_vllm.request_hints import block_hint_hashes, engine_hash_u64, raw_hint
from kvcr_vllm.router_tier import HintHashScheme, RouterHintTier, guard_endpoint_problem
from kvcr_vllm.scheduler import KVCRConnectorScheduler
from kvcr_vllm.settings import ConnectorSettings
from kvcr_vllm.stats import StatsRecorder

pytestmark = pytest.mark.unit

BLOCK_TOKENS = 4
BLOCK = 4096
PEER = "tcp://10.0.0.2:7500"
TOKENS = list(range(100, 133))  # 8 full blocks and one partial
TIER = {"router_capabilities": ["router_hint"], "control_ports": [7500],
        "control_advertise_host": "10.0.0.1"}
FIELD = "kv_connector_extra_config"
HOST = "secondary_tiers[0].control_advertise_host"
PORTS = "secondary_tiers[0].control_ports"
SECRET = secret_for("kvcr-dynamo-unit-secret-0123456789-abcdefghij")


def settings(extra: dict[str, Any], dp_rank: int = 0) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config(extra, "e", dp_rank)


def embedded(**tier: Any) -> dict[str, Any]:
    return {"peer_listen": "0.0.0.0:7500", "secondary_tiers": [{**TIER, **tier}]}


# -- secondary_tiers -----------------------------------------------------------------------------


def test_the_router_hint_tier_is_accepted_and_advertises_the_peer_endpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: kvcr refuses the key Dynamo reads to learn a worker takes hints (the worker then
    never gets one), or accepts a control endpoint that is not where peers fetch from."""
    monkeypatch.setenv("KVCR_PEER_SECRET", SECRET)
    s = settings(embedded())
    assert s.router_hint == RouterHintTier((7500,), "10.0.0.1")
    assert s.router_hint.endpoint(0) == "tcp://10.0.0.1:7500"
    assert s.hint_hashes is HintHashScheme.VLLM_ENGINE  # Dynamo sends vLLM's hashes
    assert settings({}).router_hint is None and settings({}).hint_hashes is HintHashScheme.KVCR_V1
    v6 = settings(embedded(control_advertise_host="[fd00::1]"))
    assert v6.router_hint is not None and v6.router_hint.endpoint(0) == "tcp://[fd00::1]:7500"
    guarded = settings({"mode": "guarded", "socket": "/run/kvcr/g.sock",
                        "secondary_tiers": [{**TIER, "control_ports": [7600, 7601]}]}, dp_rank=1)
    assert guarded.router_hint is not None and guarded.router_hint.endpoint(1).endswith(":7601")
    other = settings({"secondary_tiers": [{"router_capabilities": ["something_else"]}]})
    assert other.router_hint is None


@pytest.mark.parametrize("extra,field,words", [
    ({"secondary_tiers": {"a": 1}}, "secondary_tiers", "list of tiers"),
    ({"secondary_tiers": ["x"]}, "secondary_tiers[0]", "mapping"),
    ({"secondary_tiers": [{"router_capabilities": "router_hint"}]},
     "secondary_tiers[0].router_capabilities", "list of strings"),
    (embedded(control_ports=7500), PORTS, "one port"),
    (embedded(control_ports=[0]), PORTS, "one port"),
    (embedded(control_ports=[True]), PORTS, "one port"),
    (embedded(control_advertise_host="0.0.0.0"), HOST, "not 0.0.0.0"),
    (embedded(control_advertise_host="[::]"), HOST, "not 0.0.0.0"),
    (embedded(control_advertise_host=""), HOST, "host or IP"),
    (embedded(control_advertise_host="a b"), HOST, "host or IP"),
    ({"secondary_tiers": [TIER]}, PORTS, "set peer_listen"),
    ({**embedded(), "peer_listen": "0.0.0.0:7501"}, PORTS, '"0.0.0.0:7500"'),
    ({**embedded(), "peer_listen": "0.0.0.0:0"}, PORTS, "a fixed port"),
    ({**embedded(), "peer_listen": "127.0.0.1:7500"}, HOST, "binds only 127.0.0.1:7500"),
    ({**embedded(), "secondary_tiers": [TIER, TIER]}, "secondary_tiers", "exactly one"),
    ({**embedded(), "hint_hash_scheme": "sha256"}, "hint_hash_scheme", "vllm-engine"),
])
def test_a_bad_secondary_tier_names_the_entry_and_the_fix(
        extra: dict[str, Any], field: str, words: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a worker that advertises an endpoint nobody can fetch from (0.0.0.0, a port kvcr
    does not serve), found only as silent recomputes under load."""
    monkeypatch.setenv("KVCR_PEER_SECRET", SECRET)
    with pytest.raises(ConfigError) as err:
        settings(extra)
    assert f"{FIELD}.{field}" in str(err.value) and words in str(err.value)


def test_a_dp_rank_without_its_control_port_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: local DP rank 1 advertising rank 0's port (its hints then fetch the wrong pool)."""
    monkeypatch.setenv("KVCR_PEER_SECRET", SECRET)
    with pytest.raises(ConfigError, match="local DP rank 1"):
        settings(embedded(), dp_rank=1)


def test_unknown_keys_of_the_tier_are_tolerated_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Risk: a newer Dynamo adding a key to its tier entry makes every kvcr worker refuse to
    start; or the key is dropped without a word."""
    monkeypatch.setenv("KVCR_PEER_SECRET", SECRET)
    with caplog.at_level(logging.WARNING, logger="kvcr_vllm"):
        s = settings(embedded(control_protocol="zmq", priority=2))
    assert s.router_hint is not None
    assert "control_protocol, priority" in caplog.text


# -- the scheduler: hints from Request.kv_hints, vllm-engine hashes ------------------------------


def spec() -> NamespaceSpec:
    return NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32",
                         block_size_tokens=BLOCK_TOKENS, num_layers=2, num_kv_heads=2,
                         head_dim=64, layout="test/v1")


def runner() -> Runner:
    return Runner(KVCRConfig(pool_bytes=256 * BLOCK, namespace_pool_bytes=64 * BLOCK),
                  registry=CollectorRegistry())


class Node:
    """One scheduler (one TP rank) whose peer PEER is an in-process Runner holding TOKENS."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self.spec = spec()
        self.source = runner()
        keys = list(block_keys(self.spec.digest(), TOKENS, BLOCK_TOKENS))
        self.source.open_namespace(self.spec, BLOCK).store(
            keys, [pattern_block(k, BLOCK) for k in keys])
        self.keys = keys
        self.client = ObservedRunner(in_process(runner(), self.spec, BLOCK,
                                                peers=LoopbackPeers({PEER: self.source})))
        self.store = self.client.ops.stores[0]
        self.stats = StatsRecorder()
        s = ConnectorSettings.from_extra_config(
            {"mode": "guarded", "socket": "/run/kvcr/unused.sock", "peers": [PEER],
             "pull_on_miss": False, **extra}, "e")
        self.scheduler = KVCRConnectorScheduler(s, [self.spec], BLOCK, self.stats, "e",
                                                runner=self.client, clock=ManualClock())

    def admit(self, request: Any) -> tuple[int | None, bool]:
        """on_new_request, then asks until the answer is final (the loopback peer answers at
        once)."""
        self.scheduler.on_new_request(request)
        answer = self.scheduler.get_num_new_matched_tokens(request, 0)
        for _ in range(3):
            if answer[0] is not None:
                break
            answer = self.scheduler.get_num_new_matched_tokens(request, 0)
        return answer

    def counters(self) -> dict[str, int | float]:
        taken = self.stats.take()
        return {} if taken is None else taken.reduce()


def envelope(hashes: list[int], source: str = PEER) -> KvHintsEnvelope:
    """The struct dynamo.vllm builds from its router's hint (vllm.v1.kv_hints)."""
    return KvHintsEnvelope(protocol_version="0.1", message_id="m-1", actions=[KvHintAction(
        action_id="a1", action_type="kv.fetch", action_version="1.0",
        payload={"source_control_endpoint": source, "block_hashes": hashes})])


def vllm_request(request_id: str, hash_fn: str, seed: str, monkeypatch: pytest.MonkeyPatch,
                 kv_hints: KvHintsEnvelope | None = None) -> Request:
    """A real vLLM Request over TOKENS, hashed the way an engine with these settings does."""
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    fn = get_hash_fn_by_name(hash_fn)
    kv_cache_utils.init_none_hash(fn)
    return Request(request_id, TOKENS, SamplingParams(max_tokens=1), None,
                   block_hasher=kv_cache_utils.get_request_block_hasher(BLOCK_TOKENS, fn),
                   kv_hints=kv_hints)


def published(request: Request) -> list[int]:
    """The block hashes the source's KV events carried, as Dynamo's router forwards them."""
    return [int.from_bytes(h, "big") & (2**64 - 1) for h in request.block_hashes]


@pytest.mark.parametrize("hash_fn,seed", [("sha256", "0"), ("xxhash_cbor", "12345")])
def test_dynamo_hints_in_request_kv_hints_fetch_the_blocks_vllm_hashed(
        hash_fn: str, seed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: Dynamo's hint (vLLM's Request.kv_hints, vLLM engine hashes) is never read, or
    matched under the wrong hash scheme, so B recomputes what A holds; whatever the hash
    algorithm and PYTHONHASHSEED, as long as both engines agree."""
    source = vllm_request("on-a", hash_fn, seed, monkeypatch)
    hint = envelope(published(source))
    node = Node({"hint_hash_scheme": "vllm-engine"})
    target = vllm_request("on-b", hash_fn, seed, monkeypatch, kv_hints=hint)
    assert node.admit(target) == (32, True)  # all 8 blocks fetched, then offered
    assert node.client.calls["peer_fetch"] == 1
    assert node.store.load(node.keys) == [pattern_block(k, BLOCK) for k in node.keys]
    counters = node.counters()
    assert counters["hints_accepted"] == 1 and counters["peer_fetched_blocks"] == 8
    assert counters["hint_unmatched_blocks"] == 0


def test_engine_hashes_of_another_hash_setting_match_nothing_and_are_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: engines that disagree on PYTHONHASHSEED or the hash algorithm fetch blocks of
    another prompt, or silently nothing; each unmatched hash must be counted, none fetched."""
    source = vllm_request("on-a", "sha256", "0", monkeypatch)
    node = Node({"hint_hash_scheme": "vllm-engine"})
    target = vllm_request("on-b", "sha256", "1", monkeypatch,
                          kv_hints=envelope(published(source)))
    assert node.admit(target) == (0, False)
    assert node.client.calls["peer_fetch"] == 0
    assert node.counters()["hint_unmatched_blocks"] == 8


def test_a_partly_matching_hint_fetches_the_matching_prefix_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a hint whose middle block names something else leads kvcr to fetch across the
    hole (KV of another prefix under this request's keys)."""
    source = vllm_request("on-a", "sha256", "0", monkeypatch)
    hashes = published(source)
    hashes[5] = 42
    node = Node({"hint_hash_scheme": "vllm-engine"})
    target = vllm_request("on-b", "sha256", "0", monkeypatch, kv_hints=envelope(hashes))
    assert node.admit(target) == (20, True)  # blocks 0-4
    assert node.counters()["hint_unmatched_blocks"] == 1


@pytest.mark.parametrize("bad", [
    KvHintsEnvelope(protocol_version="0.1", message_id="m", actions=[]),
    KvHintsEnvelope(protocol_version="0.1", message_id="m", actions=[KvHintAction(
        action_id="a", action_type="kv.fetch", action_version="1.0",
        payload={"source_control_endpoint": "not-an-endpoint", "block_hashes": [1]})]),
    KvHintsEnvelope(protocol_version="0.1", message_id="m", actions=[KvHintAction(
        action_id="a", action_type="kv.fetch", action_version="1.0",
        payload={"source_control_endpoint": PEER, "block_hashes": ["x"]})]),
    "a string where a struct belongs",
])
def test_a_malformed_kv_hints_is_counted_and_the_request_served_without_it(
        bad: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a bad Request.kv_hints fails or hangs the request, or slips past the limits and
    counters kv_transfer_params hints go through."""
    node = Node({"hint_hash_scheme": "vllm-engine"})
    request = vllm_request("r", "sha256", "0", monkeypatch)
    request.kv_hints = bad
    assert node.admit(request) == (0, False)
    counters = node.counters()
    assert counters.get("hints_accepted", 0) == 0
    assert sum(v for k, v in counters.items() if k.startswith("hints_")) == 1


def test_a_kv_hints_naming_a_stranger_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a hint delivered by Dynamo makes kvcr dial an endpoint nobody configured."""
    source = vllm_request("on-a", "sha256", "0", monkeypatch)
    node = Node({"hint_hash_scheme": "vllm-engine"})
    target = vllm_request("on-b", "sha256", "0", monkeypatch,
                          kv_hints=envelope(published(source), "tcp://10.9.9.9:1"))
    assert node.admit(target) == (0, False)
    assert node.counters()["failures_peer_not_allowed"] == 1


def test_kv_hints_win_over_kv_transfer_params_and_both_paths_are_read() -> None:
    """Risk: the hint of one delivery path shadowing the other, or one path not read."""
    params = {"kv_hint": {"protocol_version": "0.1", "actions": []}}

    class Req:
        kv_hints: Any = None
        kv_transfer_params: Any = params

    assert raw_hint(Req()) == params["kv_hint"]
    with_struct = Req()
    with_struct.kv_hints = envelope([1, 2])
    plain = raw_hint(with_struct)
    assert isinstance(plain, dict) and plain["actions"][0]["payload"]["block_hashes"] == [1, 2]
    Req.kv_transfer_params = "kv_hint"
    assert raw_hint(Req()) is None


def test_kvcr_v1_hints_still_use_router_hashes_and_engine_hashes_need_equal_blocks() -> None:
    """Risk: the new scheme changes what kvcr-router's hints mean, or maps vLLM hashes of
    another hash block size onto kvcr's blocks."""
    keys = list(block_keys(spec().digest(), TOKENS, BLOCK_TOKENS))

    class Req:
        block_hashes: ClassVar[list[bytes]] = [bytes([i]) * 32 for i in range(8)]

    assert block_hint_hashes(HintHashScheme.KVCR_V1, Req(), keys) == [
        router_hash_kvcr_v1(k) for k in keys]
    engine = block_hint_hashes(HintHashScheme.VLLM_ENGINE, Req(), keys)
    assert engine == [engine_hash_u64(h) for h in Req.block_hashes]
    assert engine[1] == int.from_bytes(b"\x01" * 8, "big")
    Req.block_hashes = Req.block_hashes * 2  # vLLM hashed half-size blocks
    assert block_hint_hashes(HintHashScheme.VLLM_ENGINE, Req(), keys) == [None] * 8


def test_a_hint_naming_this_engines_own_shared_endpoint_is_no_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: in guarded mode the node's engines share kvcr-guard and so advertise one control
    endpoint; Dynamo hinting B to fetch from A's (= its own) endpoint was counted as a
    refused stranger, though the shared pool already serves those blocks."""
    source = vllm_request("on-a", "sha256", "0", monkeypatch)
    node = Node({"secondary_tiers": [TIER]})
    assert node.scheduler.settings.advertised_endpoint == "tcp://10.0.0.1:7500"
    node.store.store(node.keys, [pattern_block(k, BLOCK) for k in node.keys])
    target = vllm_request("on-b", "sha256", "0", monkeypatch,
                          kv_hints=envelope(published(source), "tcp://10.0.0.1:7500"))
    assert node.admit(target) == (32, True)  # served from the shared pool
    counters = node.counters()
    assert "failures_peer_not_allowed" not in counters and node.client.calls["peer_fetch"] == 0


def test_guarded_mode_checks_the_control_port_against_kvcr_guards_peer_endpoint() -> None:
    """Risk: in guarded mode Dynamo advertises a control port kvcr-guard does not serve
    peers on, and every hinted fetch from this node fails, unnoticed."""
    tier = RouterHintTier((7500, 7501), "10.0.0.1")
    assert guard_endpoint_problem(tier, 0, {"peer_endpoint": "0.0.0.0:7500"}) is None
    assert guard_endpoint_problem(tier, 1, {"peer_endpoint": "tcp://10.0.0.1:7501"}) is None
    wrong = guard_endpoint_problem(tier, 0, {"peer_endpoint": "0.0.0.0:7600"})
    assert wrong is not None and "--peer-listen" in wrong and "7600" in wrong
    none = guard_endpoint_problem(tier, 0, {"peer_endpoint": None})
    assert none is not None and "--peer-listen HOST:7500" in none
