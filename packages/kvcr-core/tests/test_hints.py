"""Router KV hints: the envelope contract, every rejection reason, fail-open intake (the
property tests are in test_hints_properties.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvcr_core import hints
from kvcr_core.endpoint import Endpoint
from kvcr_core.errors import ConfigError, HintRejected, HintRejectReason
from kvcr_core.hints import (
    HINT_ACCEPTED,
    FetchAction,
    FetchMode,
    HintIntake,
    HintLimits,
    KVHint,
    OpaqueAction,
    parse_hint,
)
from kvcr_core.metrics import RunnerMetrics
from kvcr_core.types import RouterHash

pytestmark = pytest.mark.unit

R = HintRejectReason
U64 = 1 << 64


def fetch(payload: dict[str, Any] | None = None, **action: Any) -> dict[str, Any]:
    body = {"source_control_endpoint": "tcp://worker-1:5557", "block_hashes": [1, 2, 3]}
    body.update(payload or {})
    return {"action_type": "kv.fetch", "action_version": "1.0", "payload": body, **action}


def envelope(*actions: Any, **fields: Any) -> dict[str, Any]:
    return {"protocol_version": "0.1", "message_id": "m-1",
            "actions": list(actions) if actions else [fetch()], **fields}


def rejection(raw: object, limits: HintLimits = hints.DEFAULT_LIMITS) -> HintRejected:
    with pytest.raises(HintRejected) as info:
        parse_hint(raw, limits)
    return info.value


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    # The warn-once set is process-wide by design; give each test its own.
    monkeypatch.setattr(hints, "_warned", set())


def test_reference_envelope_parses_to_typed_values() -> None:
    """The exact envelope Dynamo's router emits becomes a typed, validated KVHint."""
    hint = parse_hint(envelope(fetch(action_id="a-1", payload={"mode": "copy"})))
    hashes = frozenset(map(RouterHash, (1, 2, 3)))
    assert hint == KVHint("0.1", "m-1", (FetchAction(
        "tcp://worker-1:5557", hashes, FetchMode.COPY, "kv.fetch", "1.0", "a-1"),))
    assert hint.fetches[0].endpoint == Endpoint("worker-1", 5557)


def test_source_locations_is_accepted_as_fetch() -> None:
    """The newer action name kv.source_locations@1.0 means the same fetch."""
    hint = parse_hint(envelope(fetch(action_type="kv.source_locations")))
    assert hint.fetches[0].action_type == "kv.source_locations"
    assert hint.all_hashes() == {1, 2, 3}


def test_json_text_and_bytes_parse_like_the_mapping() -> None:
    """A kv_hint that arrives as JSON text (str or bytes) parses to the same hint."""
    raw = envelope()
    assert parse_hint(json.dumps(raw)) == parse_hint(json.dumps(raw).encode()) == parse_hint(raw)


def test_signed_hashes_are_normalised_and_duplicates_collapse() -> None:
    """Signed int64 hashes (SGLang linker) become their unsigned two's complement; a set results."""
    raw = envelope(fetch(payload={"block_hashes": [-1, -(2**63), 5, 5, U64 - 1]}))
    assert parse_hint(raw).all_hashes() == {U64 - 1, 2**63, 5}


def test_all_hashes_is_the_union_of_fetches() -> None:
    """Several fetch actions (sources) contribute all their hashes."""
    raw = envelope(fetch(payload={"block_hashes": [1, 2]}),
                   fetch(payload={"block_hashes": [2, 9], "source_control_endpoint": "tcp://b:1"}))
    assert parse_hint(raw).all_hashes() == {1, 2, 9}


def test_unknown_actions_are_kept_opaque() -> None:
    """Unknown action types pass through unchanged (forward compatibility), even alone."""
    deref: dict[str, Any] = {"action_type": "kv_hint.deref.v1", "action_id": "d",
             "payload": {"z": [1, 2.5], "a": {}}}
    hint = parse_hint(envelope(deref))
    assert hint.fetches == ()
    assert hint.opaque == (OpaqueAction("kv_hint.deref.v1", None, "d", '{"a":{},"z":[1,2.5]}'),)
    deref["payload"]["z"].append(3)  # the hint holds its own copy
    assert hint.opaque[0].payload == {"z": [1, 2.5], "a": {}}


def test_optional_fields_default_and_move_and_false_no_retain_accepted() -> None:
    """Absent versions/mode mean 0.1/1.0/copy; mode move and no_retain=false are accepted."""
    action = fetch(payload={"mode": "move", "no_retain": False})
    del action["action_version"]
    hint = parse_hint({"actions": [action, fetch(payload={"mode": None})]})
    assert (hint.protocol_version, hint.message_id) == ("0.1", None)
    assert [(f.action_version, f.mode) for f in hint.fetches] == [
        ("1.0", FetchMode.MOVE), ("1.0", FetchMode.COPY)]


@pytest.mark.parametrize(("text", "canonical"), [
    ("tcp://[0:0::1]:05000", "tcp://[::1]:5000"),
    ("tcp://[2001:DB8::1]:1", "tcp://[2001:db8::1]:1"),
    ("tcp://10.0.0.7:65535", "tcp://10.0.0.7:65535"),
    ("tcp://kvcr-0.kvcr.default.svc:5557", "tcp://kvcr-0.kvcr.default.svc:5557"),
    ("tcp://3f4e5a6b7c8d:80", "tcp://3f4e5a6b7c8d:80"),
])
def test_endpoints_are_canonicalised(text: str, canonical: str) -> None:
    """Accepted endpoints are stored in one canonical form (IPv6 compressed and bracketed)."""
    source = parse_hint(envelope(fetch(payload={"source_control_endpoint": text}))).fetches[0]
    assert source.source_endpoint == canonical == str(source.endpoint)


def _many(n: int) -> list[dict[str, Any]]:
    return [fetch() for _ in range(n)]


class Untouchable(list):  # type: ignore[type-arg]
    """A list whose elements may not be read: proves a bound is checked on the length alone."""

    def __iter__(self) -> Any:
        raise AssertionError("elements were read")

    def __getitem__(self, index: Any) -> Any:
        raise AssertionError("elements were read")


def _hashes(value: Any) -> dict[str, Any]:
    return envelope(fetch(payload={"block_hashes": value}))


def _endpoint(value: Any) -> dict[str, Any]:
    return envelope(fetch(payload={"source_control_endpoint": value}))


def _opaque(payload: Any) -> dict[str, Any]:
    return envelope({"action_type": "kv_hint.prefetch.v1", "payload": payload})


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = {"k": [value]}
    return value


MISSING_ENDPOINT = envelope(fetch())
del MISSING_ENDPOINT["actions"][0]["payload"]["source_control_endpoint"]
MISSING_HASHES = envelope(fetch())
del MISSING_HASHES["actions"][0]["payload"]["block_hashes"]
REJECTIONS: list[tuple[object, HintRejectReason, str]] = [
    ("{not json", R.BAD_JSON, "not UTF-8 JSON"),
    (b'{"actions": \xff}', R.BAD_JSON, "not UTF-8 JSON"),
    ('{"actions": [' + "9" * 60 + "]}", R.BAD_JSON, "60 digits"),
    ("[" * 100_000, R.BAD_JSON, "nested too deeply"),
    (b" " * ((1 << 20) + 1), R.TOO_LARGE, "max_bytes=1048576"),
    ('"' + "é" * ((1 << 19) + 1) + '"', R.TOO_LARGE, "1048580 bytes"),
    (None, R.NOT_A_MAPPING, "the kv_hint is None"),
    ([envelope()], R.NOT_A_MAPPING, "the kv_hint is a list of 1 items"),
    ("[1]", R.NOT_A_MAPPING, "send a mapping"),
    (envelope(protocol_version=0.1), R.NOT_A_MAPPING, "kv_hint.protocol_version is 0.1"),
    (envelope(message_id=7), R.NOT_A_MAPPING, "kv_hint.message_id is 7"),
    ({"protocol_version": "0.1"}, R.BAD_ACTIONS, "kv_hint.actions is missing"),
    (envelope(actions="kv.fetch"), R.BAD_ACTIONS, "kv_hint.actions is 'kv.fetch'"),
    (envelope(fetch(), 3), R.BAD_ACTIONS, "actions[1] is 3"),
    (envelope({"payload": {}}), R.BAD_ACTIONS, "actions[0].action_type is missing"),
    (envelope(fetch(action_type=["kv.fetch"])), R.BAD_ACTIONS, "action_type is a list"),
    (envelope(fetch(action_version=1.0)), R.BAD_ACTIONS, "actions[0].action_version is 1.0"),
    (envelope(fetch(action_id=5)), R.BAD_ACTIONS, "actions[0].action_id is 5"),
    (envelope(*_many(65)), R.TOO_MANY_ACTIONS, "max_actions=64"),
    (envelope(actions=[]), R.NO_USABLE_ACTION, "send at least one action"),
    (envelope({"action_type": "kv.fetch"}), R.BAD_PAYLOAD, "actions[0].payload is missing"),
    (envelope({"action_type": "kv.fetch", "payload": [1]}), R.BAD_PAYLOAD, "payload is a list"),
    (_opaque({"x": float("nan")}), R.BAD_PAYLOAD, "found nan"),
    (_opaque({"x": {1: "a"}}), R.BAD_PAYLOAD, "string keys"),
    (_opaque({"x": {1, 2}}), R.BAD_PAYLOAD, "found a set"),
    (_opaque({"x": 10**30}), R.BAD_PAYLOAD, "64-bit numbers"),
    (_opaque(_nested(100_000)), R.BAD_PAYLOAD, "32 levels"),
    (_opaque({"x": list(range(70_000))}), R.BAD_PAYLOAD, "65536 values"),
    (MISSING_ENDPOINT, R.BAD_ENDPOINT, "source_control_endpoint is missing"),
    (_endpoint(5557), R.BAD_ENDPOINT, "source_control_endpoint is 5557"),
    (_endpoint(""), R.BAD_ENDPOINT, "'tcp://HOST:PORT'"),
    (_endpoint("worker-1:5557"), R.BAD_ENDPOINT, "'worker-1:5557'"),
    (_endpoint("http://worker-1:5557"), R.BAD_ENDPOINT, "http://"),
    (_endpoint("tcp://worker-1"), R.BAD_ENDPOINT, "port 1-65535"),
    (_endpoint("tcp://worker-1:0"), R.BAD_ENDPOINT, "port 1-65535"),
    (_endpoint("tcp://worker-1:65536"), R.BAD_ENDPOINT, "port 1-65535"),
    (_endpoint("tcp://:5557"), R.BAD_ENDPOINT, "'tcp://:5557'"),
    (_endpoint("tcp://::1:5557"), R.BAD_ENDPOINT, "[IPv6]"),
    (_endpoint("tcp://[::g]:5557"), R.BAD_ENDPOINT, "[IPv6]"),
    (_endpoint("tcp://[fe80::1%eth0]:5557"), R.BAD_ENDPOINT, "[IPv6]"),
    (_endpoint("tcp://worker-1:5557/path"), R.BAD_ENDPOINT, "/path"),
    (_endpoint("tcp://user@worker-1:5557"), R.BAD_ENDPOINT, "user@"),
    (_endpoint("tcp://worker-1:5557\n"), R.BAD_ENDPOINT, "\\n"),
    (_endpoint("tcp://worker 1:5557"), R.BAD_ENDPOINT, "worker 1"),
    (_endpoint("tcp://-worker:5557"), R.BAD_ENDPOINT, "-worker"),
    (_endpoint("tcp://a..b:5557"), R.BAD_ENDPOINT, "a..b"),
    (_endpoint("tcp://worker-1:٥٥٥٧"), R.BAD_ENDPOINT, "port 1-65535"),
    (_endpoint("tcp://256.0.0.1:5557"), R.BAD_ENDPOINT, "256.0.0.1"),
    (_endpoint("tcp://10.1:5557"), R.BAD_ENDPOINT, "10.1"),
    (_endpoint("tcp://0x7f.1:5557"), R.BAD_ENDPOINT, "0x7f.1"),
    (_endpoint("tcp://" + "a" * 300 + ":5557"), R.BAD_ENDPOINT, "(311 chars)"),
    (MISSING_HASHES, R.BAD_HASHES, "block_hashes is missing"),
    (_hashes("1,2"), R.BAD_HASHES, "block_hashes is '1,2'"),
    (_hashes([]), R.BAD_HASHES, "a list of 0 items"),
    (_hashes([1, True]), R.BAD_HASHES, "block_hashes[1] is True, not an integer"),
    (_hashes([1.0]), R.BAD_HASHES, "block_hashes[0] is 1.0, not an integer"),
    (_hashes(["7"]), R.BAD_HASHES, "block_hashes[0] is '7', not an integer"),
    (_hashes([float("inf")]), R.BAD_HASHES, "block_hashes[0] is inf"),
    (_hashes([U64]), R.BAD_HASHES, "is 18446744073709551616, outside"),
    (_hashes([-(2**63) - 1]), R.BAD_HASHES, "outside the signed/unsigned 64-bit range"),
    (_hashes([1, -(2**70)]), R.BAD_HASHES, "block_hashes[1] is -1180591620717411303424, out"),
    (_hashes([10**5000]), R.BAD_HASHES, "is an integer of 16610 bits"),
    (_hashes(Untouchable(range(65_537))), R.TOO_MANY_HASHES, "max_hashes=65536"),
    (envelope(fetch(payload={"mode": "steal"})), R.UNSUPPORTED_MODE, "mode is 'steal'"),
    (envelope(fetch(payload={"mode": "COPY"})), R.UNSUPPORTED_MODE, "'copy' or 'move'"),
    (envelope(fetch(payload={"mode": 1})), R.UNSUPPORTED_MODE, "mode is 1"),
    (envelope(fetch(payload={"no_retain": True})), R.UNSUPPORTED_OPTION, "no_retain is True"),
    (envelope(fetch(payload={"no_retain": "yes"})), R.UNSUPPORTED_OPTION, "send false"),
]


@pytest.mark.parametrize(("raw", "reason", "detail"), REJECTIONS)
def test_bad_hints_are_rejected_with_reason_and_detail(
        raw: object, reason: HintRejectReason, detail: str) -> None:
    """Each malformed hint gets its own bounded reason and a detail naming the field and fix."""
    exc = rejection(raw)
    assert exc.reason is reason
    assert detail in exc.detail


def test_every_reject_reason_has_a_concrete_example() -> None:
    """No rejection reason is left without a test case."""
    assert {reason for _, reason, _ in REJECTIONS} == set(HintRejectReason)


def test_limits_are_configurable() -> None:
    """Lower limits refuse smaller hints, with the configured bound in the detail."""
    limits = HintLimits(max_actions=2, max_hashes=3, max_bytes=200)
    assert rejection(envelope(*_many(3)), limits).reason is R.TOO_MANY_ACTIONS
    assert rejection(_hashes([1, 2, 3, 4]), limits).detail.endswith(
        "send at most max_hashes=3 per action (split the fetch)")
    assert rejection(json.dumps(_hashes(list(range(40)))), limits).reason is R.TOO_LARGE
    assert parse_hint(_hashes([1, 2, 3]), limits).all_hashes() == {1, 2, 3}


@pytest.mark.parametrize(("field", "value"), [
    ("max_actions", 65), ("max_actions", 0), ("max_hashes", -1), ("max_bytes", True),
    ("max_bytes", 1.5)])
def test_limits_are_validated(field: str, value: Any) -> None:
    """A bad limit (or more actions than the protocol's 64) is a ConfigError naming the field."""
    with pytest.raises(ConfigError, match=f"HintLimits.{field}"):
        HintLimits(**{field: value})


def test_to_envelope_is_json_safe_with_sorted_hashes() -> None:
    """The emitted envelope is plain JSON, hashes ascending, absent fields omitted."""
    hint = parse_hint({"actions": [fetch(payload={"block_hashes": [9, -1, 3]})]})
    out = hint.to_envelope()
    assert json.loads(json.dumps(out, allow_nan=False)) == out == {
        "protocol_version": "0.1", "actions": [{
            "action_type": "kv.fetch", "action_version": "1.0", "payload": {
                "source_control_endpoint": "tcp://worker-1:5557",
                "block_hashes": [3, 9, U64 - 1], "mode": "copy"}}]}


def test_hints_are_immutable_values() -> None:
    """Parsed hints are frozen and hashable, so they can be shared across threads."""
    hint = parse_hint(envelope(fetch(), {"action_type": "x", "payload": {"a": [1]}}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        hint.fetches[0].block_hashes = frozenset()  # type: ignore[misc]
    assert {hint: 1}[parse_hint(hint.to_envelope())] == 1


def _registry_intake(limits: HintLimits = hints.DEFAULT_LIMITS) -> tuple[
        HintIntake, CollectorRegistry]:
    registry = CollectorRegistry()
    return HintIntake(RunnerMetrics(registry), limits), registry


def _count(registry: CollectorRegistry, outcome: str) -> float | None:
    return registry.get_sample_value("kvcr_hints_total", {"outcome": outcome})


def test_intake_counts_outcomes_and_fails_open(fresh_warnings: None) -> None:
    """Accepted and rejected hints move kvcr_hints_total; a rejection yields None, no raise."""
    intake, registry = _registry_intake()
    assert intake.accept(envelope()) == parse_hint(envelope())
    assert intake.accept(_hashes([True])) is None
    assert intake.accept("{") is None
    assert intake.accept(None) is None  # no hint at all: nothing to count
    assert _count(registry, HINT_ACCEPTED) == 1
    assert _count(registry, "bad_hashes") == _count(registry, "bad_json") == 1
    assert _count(registry, "bad_endpoint") == 0


def test_intake_without_metrics_still_parses() -> None:
    """metrics=None is allowed (tests, tools): the intake still parses and fails open."""
    intake = HintIntake(None, HintLimits(max_actions=1))
    assert intake.accept(envelope(*_many(2))) is None
    assert intake.accept(envelope()) is not None


def test_rejections_warn_once_per_reason_then_debug(
        fresh_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    """A router stuck sending bad hints logs one WARNING per reason, then DEBUG (no flood)."""
    caplog.set_level(logging.DEBUG, logger="kvcr_core.hints")
    intake, _ = _registry_intake()
    for _ in range(3):
        intake.accept(_endpoint("tcp://nowhere"))
    intake.accept(_hashes([]))
    levels = [(r.levelno, "bad_endpoint" in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.WARNING, True), (logging.DEBUG, True), (logging.DEBUG, True),
                      (logging.WARNING, False)]


def test_version_mismatch_parses_and_warns_once(
        fresh_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    """Other protocol/action versions still parse; each distinct value warns once per process."""
    caplog.set_level(logging.WARNING, logger="kvcr_core.hints")
    intake, registry = _registry_intake()
    raw = envelope(fetch(action_version="1.1"), protocol_version="0.2")
    for _ in range(3):
        hint = intake.accept(raw)
        assert hint is not None and hint.all_hashes() == {1, 2, 3}
    assert intake.accept(envelope(protocol_version="0.3")) is not None
    warned = [r.getMessage() for r in caplog.records]
    assert all("(warned once per value)" in m for m in warned)
    assert sorted(m.split(" is ")[1].split(" ")[0] for m in warned) == ["'0.2'", "'0.3'", "'1.1'"]
    assert _count(registry, HINT_ACCEPTED) == 4
    assert parse_hint(raw).protocol_version == "0.2"


def test_warn_once_memory_is_bounded(
        fresh_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    """A router sending endless distinct versions cannot grow memory: 64 values are kept."""
    caplog.set_level(logging.WARNING, logger="kvcr_core.hints")
    intake = HintIntake(None)
    for i in range(100):
        intake.accept(envelope(protocol_version=f"9.{i}"))
    assert len(caplog.records) == len(hints._warned) == 64


def test_parse_hint_itself_does_not_log(caplog: pytest.LogCaptureFixture) -> None:
    """parse_hint is pure: logging (and counting) belongs to HintIntake."""
    caplog.set_level(logging.DEBUG, logger="kvcr_core.hints")
    assert parse_hint(envelope(protocol_version="7.7")).protocol_version == "7.7"
    assert rejection("{").reason is R.BAD_JSON
    assert caplog.records == []
