"""Router KV hints, property tests (the parser's contract on arbitrary input: a hint or
HintRejected, never another exception; valid envelopes round-trip; split hints fit). Risk:
a malformed hint from a faulty or hostile router crashes or wedges the code that reads it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcr_core import hints
from kvcr_core.errors import HintRejected, HintRejectReason
from kvcr_core.hints import FETCH_ACTION_TYPES, KVHint, parse_hint

pytestmark = pytest.mark.unit

U64 = 1 << 64
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

FIELD_NAMES = ["protocol_version", "message_id", "actions", "action_id", "action_type",
               "action_version", "payload", "source_control_endpoint", "block_hashes", "mode",
               "no_retain"]
ODD_NUMBERS = [U64, U64 - 1, -(2**63), -(2**63) - 1, 2**63,
               float("nan"), float("inf"), -0.0, 1e308]
json_scalars = (st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70)
                | st.sampled_from(ODD_NUMBERS) | st.floats() | st.text(max_size=12)
                | st.builds(pow, st.sampled_from([10, -10]), st.integers(4000, 6000))
                | st.sampled_from(["kv.fetch", "kv.source_locations", "copy", "move",
                                   "tcp://h:1", "tcp://[::1]:80", "0.1", "1.0"]))
json_keys = st.sampled_from(FIELD_NAMES) | st.text(max_size=8) | st.integers() | st.none()
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(json_keys, inner, max_size=5),
    max_leaves=25)
plain_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), U64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=10)
hosts = st.sampled_from(["localhost", "worker-1", "kvcr-0.kvcr.svc", "10.0.0.7", "[::1]",
                         "[FE80::0:1]", "[2001:db8::ff00:42:8329]", "a_b", "3f4e5a6b7c8d"])
endpoints = st.builds("tcp://{}:{}".format, hosts, st.integers(1, 65535))
maybe = st.none() | st.text(max_size=6)


@st.composite
def valid_actions(draw: st.DrawFn) -> dict[str, Any]:
    action: dict[str, Any] = {}
    if draw(st.booleans()):
        payload: dict[str, Any] = {
            "source_control_endpoint": draw(endpoints),
            "block_hashes": draw(st.lists(st.integers(-(2**63), U64 - 1), min_size=1,
                                          max_size=20))}
        payload.update(draw(st.fixed_dictionaries({}, optional={
            "mode": st.sampled_from(["copy", "move"]) | st.none(),
            "no_retain": st.just(False) | st.none(), "extra": plain_json})))
        action["action_type"] = draw(st.sampled_from(sorted(FETCH_ACTION_TYPES)))
        action["action_version"] = draw(st.sampled_from(["1.0", "1.1"]) | st.none())
    else:
        action["action_type"] = draw(st.text(max_size=12).filter(
            lambda t: t not in FETCH_ACTION_TYPES))
        action["action_version"] = draw(maybe)
        payload = draw(st.dictionaries(st.text(max_size=6), plain_json, max_size=4))
    action["action_id"] = draw(maybe)
    action["payload"] = payload
    return action


@st.composite
def valid_envelopes(draw: st.DrawFn) -> dict[str, Any]:
    return {"protocol_version": draw(st.sampled_from(["0.1", "0.2"]) | st.none()),
            "message_id": draw(maybe),
            "actions": draw(st.lists(valid_actions(), min_size=1, max_size=4))}


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out += _paths(item, (*path, index))
    return out


def _check_contract(raw: object) -> KVHint | None:
    """parse_hint either rejects with a typed reason or returns a hint that round-trips."""
    try:
        hint = parse_hint(raw)
    except HintRejected as exc:
        assert isinstance(exc.reason, HintRejectReason) and exc.detail
        event(exc.reason.value)
        return None
    event("accepted")
    out = hint.to_envelope()
    assert parse_hint(out) == hint
    assert parse_hint(json.dumps(out, allow_nan=False)) == hint
    return hint


@FUZZ
@given(json_values)
def test_arbitrary_json_values_only_raise_hint_rejected(value: Any) -> None:
    """Any JSON-like value, bare, as the actions list, or as text, yields a hint or a reason."""
    _check_contract(value)
    _check_contract({"protocol_version": "0.1", "actions": value})
    _check_contract({"protocol_version": "0.1", "message_id": "m-1", "actions": [{
        "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": "tcp://worker-1:5557", "block_hashes": value}}]})
    try:
        text = json.dumps(value)
    except (ValueError, TypeError):  # huge ints or non-str keys: not representable as JSON
        return
    _check_contract(text)


@FUZZ
@given(st.data())
def test_mutated_envelopes_only_raise_hint_rejected(data: st.DataObject) -> None:
    """Valid envelopes with fields replaced or deleted are accepted (round-trip) or rejected."""
    raw: Any = data.draw(valid_envelopes())
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(raw)))
        if not path:
            raw = data.draw(json_values)
            continue
        parent = raw
        for step in path[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(json_values)
    _check_contract(raw)


@FUZZ
@given(valid_envelopes())
def test_valid_envelopes_are_accepted_and_round_trip(raw: dict[str, Any]) -> None:
    """Every valid envelope is accepted, keeps its hashes (normalised), and round-trips."""
    hint = _check_contract(raw)
    assert hint is not None
    expected = {h % U64 for a in raw["actions"] if a["action_type"] in FETCH_ACTION_TYPES
                for h in a["payload"]["block_hashes"]}
    assert hint.all_hashes() == expected
    assert len(hint.fetches) + len(hint.opaque) == len(raw["actions"])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=3000),
       st.integers(1, 300), st.sampled_from(["copy", "move"]))
def test_split_hint_parts_fit_and_name_the_same_fetches(hashes: list[int], tail: int,
                                                        mode: str) -> None:
    """Risk: a large hint posted by an attached client in parts loses or moves hashes
    between sources, changes the fetch mode, or makes parts still too large for a request."""
    envelope = json.dumps({"protocol_version": "0.1", "message_id": "m-9", "actions": [
        {"action_type": "kv.fetch", "payload": {"source_control_endpoint": "tcp://a:1",
                                                "block_hashes": hashes, "mode": mode}},
        {"action_type": "kv.fetch", "payload": {"source_control_endpoint": "tcp://b:2",
                                                "block_hashes": hashes[:tail]}},
        {"action_type": "x.other", "payload": {"k": 1}}]})
    parts = hints.split_hint(envelope, 2048)
    if len(envelope) <= 2048:
        assert parts == [envelope]
        return
    got: set[tuple[str, int, str]] = set()
    for part in parts:
        assert len(part) <= 2048
        for fetch in parse_hint(part).fetches:
            got |= {(fetch.source_endpoint, h, fetch.mode.value) for h in fetch.block_hashes}
    assert got == ({("tcp://a:1", h, mode) for h in hashes}
                   | {("tcp://b:2", h, "copy") for h in hashes[:tail]})


def test_split_hint_refuses_what_does_not_parse() -> None:
    """Risk: an oversized garbage hint is sent anyway (and costs the runner a parse)."""
    with pytest.raises(HintRejected):
        hints.split_hint("[" * 5000, 1024)
