"""Router KV hints: owns the `kv_hint` envelope (protocol 0.1) as workers read it from vLLM's
`kv_transfer_params["kv_hint"]`, with `kv.fetch@1.0` or its newer name `kv.source_locations@1.0`.

Threading: `parse_hint` is pure and every value is frozen. `HintIntake` adds the side effects
(metrics, and logs: WARNING once per process per rejection reason or odd version, behind a
lock and bounded, DEBUG after).

Contract: `parse_hint` returns a validated `KVHint` or raises `HintRejected` (bounded reason,
detail naming the field and the fix), nothing else, for any input made of JSON-like values.
Sizes are checked against `HintLimits` before anything is copied. Endpoints are plain
`tcp://host:port`. Hashes are a set of u64; signed int64 ones (SGLang linker) are taken as two's
complement. Unknown action types stay as `OpaqueAction`. Absent versions mean the current ones,
others parse and warn once. A mistyped envelope field (`protocol_version`, `message_id`) is
NOT_A_MAPPING, a mistyped action field (`action_type`, `action_version`, `action_id`)
BAD_ACTIONS. JSON null counts as absent for optional fields. `HintIntake` fails open.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import threading
from collections.abc import Mapping
from typing import Any, Protocol, cast

from kvcr_core.endpoint import Endpoint
from kvcr_core.errors import ConfigError, HintRejected, HintRejectReason
from kvcr_core.types import RouterHash

HINT_ACCEPTED = "accepted"
HINT_OUTCOMES = (HINT_ACCEPTED, *(r.value for r in HintRejectReason))
"""Every outcome a hint intake counts (a bounded metrics label)."""
"""The outcome label of an accepted hint; rejections use `HintRejectReason` values."""


class HintOutcomeSink(Protocol):
    """Where `HintIntake` counts outcomes (`RunnerMetrics` is one)."""

    def hint_outcome(self, outcome: str) -> None: ...

PROTOCOL_VERSION = "0.1"
FETCH_ACTION_VERSION = "1.0"
FETCH_ACTION_TYPES = frozenset({"kv.fetch", "kv.source_locations"})
MAX_ACTIONS_CAP = 64
"""Protocol bound on actions per envelope (SGLang unified cache); limits may only go lower."""

_log = logging.getLogger(__name__)
_R = HintRejectReason
_MISSING: Any = object()
_U64 = 1 << 64
_I64_MIN = -(1 << 63)
_MAX_JSON_INT_DIGITS = 40  # a 64-bit value needs at most 20; longer is refused before int()
_OPAQUE_MAX_DEPTH = 32
_OPAQUE_MAX_VALUES = 65536
_WARN_ONCE_MAX = 64
_HASHES_FIX = "send a non-empty list of unsigned 64-bit integers"


class FetchMode(enum.Enum):
    """What the source may do after a successful fetch: keep its copy, or drop it (move)."""

    COPY = "copy"
    MOVE = "move"


_MODES = {mode.value: mode for mode in FetchMode}


@dataclasses.dataclass(frozen=True, slots=True)
class HintLimits:
    """Bounds applied to every hint before it is copied. Validated on construction."""

    max_actions: int = MAX_ACTIONS_CAP
    max_hashes: int = 65536
    max_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"HintLimits.{field.name}", value, "use a positive integer")
        if self.max_actions > MAX_ACTIONS_CAP:
            raise ConfigError("HintLimits.max_actions", self.max_actions,
                              f"the protocol allows at most {MAX_ACTIONS_CAP}; use a value <= it")


DEFAULT_LIMITS = HintLimits()


@dataclasses.dataclass(frozen=True, slots=True)
class FetchAction:
    """Fetch these blocks (by router hash, a set: it may cover only a suffix) from a source."""

    source_endpoint: str
    block_hashes: frozenset[RouterHash]
    mode: FetchMode = FetchMode.COPY
    action_type: str = "kv.fetch"
    action_version: str = FETCH_ACTION_VERSION
    action_id: str | None = None

    @property
    def endpoint(self) -> Endpoint:
        """The source as host and port (`source_endpoint` is already canonical)."""
        return Endpoint.parse(self.source_endpoint, describe=_describe)

    @property
    def payload(self) -> dict[str, Any]:
        return {"source_control_endpoint": self.source_endpoint,
                "block_hashes": sorted(self.block_hashes), "mode": self.mode.value}


@dataclasses.dataclass(frozen=True, slots=True)
class OpaqueAction:
    """An action kvcr does not consume, kept as canonical JSON so it can be passed on."""

    action_type: str
    action_version: str | None
    action_id: str | None
    payload_json: str

    @property
    def payload(self) -> dict[str, Any]:
        return cast(dict[str, Any], json.loads(self.payload_json))


@dataclasses.dataclass(frozen=True, slots=True)
class KVHint:
    """One request's validated hint: fetch actions in arrival order, then opaque ones."""

    protocol_version: str
    message_id: str | None
    fetches: tuple[FetchAction, ...]
    opaque: tuple[OpaqueAction, ...] = ()

    def all_hashes(self) -> frozenset[RouterHash]:
        return frozenset().union(*(fetch.block_hashes for fetch in self.fetches))

    def to_envelope(self) -> dict[str, Any]:
        """The JSON-safe envelope (hashes sorted); `parse_hint(h.to_envelope()) == h`."""
        actions: list[dict[str, Any]] = []
        parsed: tuple[FetchAction | OpaqueAction, ...] = (*self.fetches, *self.opaque)
        for action in parsed:
            fields = {"action_type": action.action_type, "action_version": action.action_version,
                      "action_id": action.action_id, "payload": action.payload}
            actions.append({key: value for key, value in fields.items() if value is not None})
        envelope = {"protocol_version": self.protocol_version, "message_id": self.message_id,
                    "actions": actions}
        return {key: value for key, value in envelope.items() if value is not None}


def parse_hint(raw: object, limits: HintLimits = DEFAULT_LIMITS) -> KVHint:
    """Validate a `kv_hint` (a mapping, or its JSON as str/bytes). Raises only HintRejected."""
    envelope = _decode_json(raw, limits) if isinstance(raw, (str, bytes, bytearray)) else raw
    if not isinstance(envelope, Mapping):
        raise _bad(_R.NOT_A_MAPPING, "the kv_hint", envelope, "send a mapping "
                   "{'protocol_version': '0.1', 'actions': [...]} or its JSON text")
    protocol_version = _optional_str(envelope, "protocol_version", "kv_hint", _R.NOT_A_MAPPING)
    message_id = _optional_str(envelope, "message_id", "kv_hint", _R.NOT_A_MAPPING)
    actions = envelope.get("actions", _MISSING)
    if not isinstance(actions, (list, tuple)):
        raise _bad(_R.BAD_ACTIONS, "kv_hint.actions", actions,
                   "send a list of {'action_type': ..., 'payload': {...}} mappings")
    if not actions:
        raise _bad(_R.NO_USABLE_ACTION, "kv_hint.actions", actions,
                   "send at least one action (kv.fetch) or no kv_hint at all")
    if len(actions) > limits.max_actions:
        raise _bad(_R.TOO_MANY_ACTIONS, "kv_hint.actions", actions,
                   f"send at most max_actions={limits.max_actions}")
    parsed = [_parse_action(action, f"actions[{i}]", limits) for i, action in enumerate(actions)]
    return KVHint(PROTOCOL_VERSION if protocol_version is None else protocol_version, message_id,
                  tuple(a for a in parsed if isinstance(a, FetchAction)),
                  tuple(a for a in parsed if isinstance(a, OpaqueAction)))


def split_hint(envelope: str, max_bytes: int) -> list[str]:
    """`envelope` as JSON envelopes of at most `max_bytes` each (where its other fields allow)
    that together name the same fetches: itself when it fits; else one per part of each fetch
    action's hashes (opaque actions, which only engines pass on, are left out). Raises
    HintRejected for an envelope that does not parse."""
    if len(envelope) <= max_bytes:
        return [envelope]
    hint = parse_hint(envelope)
    parts: list[str] = []
    for fetch in hint.fetches:
        def text(hashes: list[RouterHash], fetch: FetchAction = fetch) -> str:
            action = dataclasses.replace(fetch, block_hashes=frozenset(hashes))
            return json.dumps(KVHint(hint.protocol_version, hint.message_id,
                                     (action,)).to_envelope(), separators=(",", ":"))
        hashes = sorted(fetch.block_hashes)
        step = max(1, (max_bytes - len(text([]))) // 21)  # a u64 is at most 20 digits and ","
        parts.extend(text(hashes[i:i + step]) for i in range(0, len(hashes), step))
    return parts


def _parse_action(action: object, where: str, limits: HintLimits) -> FetchAction | OpaqueAction:
    if not isinstance(action, Mapping):
        raise _bad(_R.BAD_ACTIONS, where, action,
                   "send a mapping with a string action_type and a payload mapping")
    action_type = action.get("action_type", _MISSING)
    if not isinstance(action_type, str):
        raise _bad(_R.BAD_ACTIONS, f"{where}.action_type", action_type,
                   "send a string such as 'kv.fetch'")
    version = _optional_str(action, "action_version", where, _R.BAD_ACTIONS)
    action_id = _optional_str(action, "action_id", where, _R.BAD_ACTIONS)
    payload = action.get("payload", _MISSING)
    where = f"{where}.payload"
    if not isinstance(payload, Mapping):
        raise _bad(_R.BAD_PAYLOAD, where, payload,
                   "send a mapping (kv.fetch: source_control_endpoint and block_hashes)")
    if action_type not in FETCH_ACTION_TYPES:
        return OpaqueAction(action_type, version, action_id, _canonical_json(payload, where))
    no_retain = payload.get("no_retain")
    if no_retain is not None and no_retain is not False:
        raise _bad(_R.UNSUPPORTED_OPTION, f"{where}.no_retain", no_retain,
                   "kvcr always keeps fetched blocks: send false or omit it")
    mode = payload.get("mode")
    if mode is not None and (not isinstance(mode, str) or mode not in _MODES):
        raise _bad(_R.UNSUPPORTED_MODE, f"{where}.mode", mode,
                   "send 'copy' or 'move', or omit it (copy)")
    endpoint = Endpoint.parse(payload.get("source_control_endpoint", _MISSING),
                              f"{where}.source_control_endpoint", describe=_describe)
    hashes = _parse_hashes(payload.get("block_hashes", _MISSING), f"{where}.block_hashes", limits)
    return FetchAction(str(endpoint), hashes, _MODES[mode] if mode else FetchMode.COPY,
                       action_type, FETCH_ACTION_VERSION if version is None else version,
                       action_id)


def _parse_hashes(raw: object, where: str, limits: HintLimits) -> frozenset[RouterHash]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise _bad(_R.BAD_HASHES, where, raw, _HASHES_FIX)
    if len(raw) > limits.max_hashes:  # before touching the elements: refusing is O(1)
        raise _bad(_R.TOO_MANY_HASHES, where, raw,
                   f"send at most max_hashes={limits.max_hashes} per action (split the fetch)")
    if all(type(h) is int for h in raw) and min(raw) >= 0 and max(raw) < _U64:
        return cast(frozenset[RouterHash], frozenset(raw))
    hashes: set[int] = set()
    for index, value in enumerate(raw):
        if isinstance(value, bool) or not isinstance(value, int):
            raise HintRejected(_R.BAD_HASHES, f"{where}[{index}] is {_describe(value)}, not an "
                               f"integer: {_HASHES_FIX}")
        if not _I64_MIN <= value < _U64:
            raise HintRejected(_R.BAD_HASHES, f"{where}[{index}] is {_describe(value)}, outside "
                               f"the signed/unsigned 64-bit range: {_HASHES_FIX}")
        hashes.add(int(value) % _U64)  # two's complement for signed int64 hashes
    return cast(frozenset[RouterHash], frozenset(hashes))


def _optional_str(mapping: Mapping[Any, Any], key: str, where: str,
                  reason: HintRejectReason) -> str | None:
    value = mapping.get(key)
    if value is None or isinstance(value, str):
        return value
    raise _bad(reason, f"{where}.{key}", value, "send a string or omit it")


def _canonical_json(payload: Mapping[Any, Any], where: str) -> str:
    """Copy an opaque payload into plain JSON values, bounded in depth and size."""
    budget = _OPAQUE_MAX_VALUES

    def copy(value: object, depth: int) -> object:
        nonlocal budget
        budget -= 1
        if value is None or isinstance(value, (bool, str)):
            return str(value) if isinstance(value, str) else value
        if isinstance(value, int) and _I64_MIN <= value < _U64:
            return int(value)
        if isinstance(value, float) and math.isfinite(value):
            return float(value)
        if not isinstance(value, (list, tuple, Mapping)) or depth >= _OPAQUE_MAX_DEPTH \
                or len(value) > budget:
            raise _bad(_R.BAD_PAYLOAD, where, payload, "opaque payloads must be plain JSON: "
                       f"finite 64-bit numbers, string keys, {_OPAQUE_MAX_DEPTH} levels, "
                       f"{_OPAQUE_MAX_VALUES} values at most (found {_describe(value)})")
        if not isinstance(value, Mapping):
            return [copy(item, depth + 1) for item in value]
        if not all(isinstance(key, str) for key in value):
            raise _bad(_R.BAD_PAYLOAD, where, payload, "send a mapping with string keys only")
        return {str(key): copy(item, depth + 1) for key, item in value.items()}

    return json.dumps(copy(payload, 0), sort_keys=True, separators=(",", ":"), allow_nan=False)


def _decode_json(raw: str | bytes | bytearray, limits: HintLimits) -> object:
    size = len(raw)  # a str never has more characters than UTF-8 bytes: cheap first test
    if isinstance(raw, str) and size <= limits.max_bytes:
        size = len(raw.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise HintRejected(_R.TOO_LARGE, f"the kv_hint JSON has {size} bytes, more than "
                           f"max_bytes={limits.max_bytes}: send fewer hashes per hint")
    try:
        text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
        return json.loads(text, parse_int=_json_int)
    except RecursionError:
        raise HintRejected(_R.BAD_JSON, "the kv_hint JSON is nested too deeply: send the flat "
                           "envelope {'protocol_version', 'actions': [...]}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, _json_int
        raise HintRejected(_R.BAD_JSON, f"the kv_hint is not UTF-8 JSON ({exc}): send a JSON "
                           "object") from None


def _json_int(text: str) -> int:
    if len(text) > _MAX_JSON_INT_DIGITS:
        raise ValueError(f"an integer literal of {len(text)} digits is beyond 64 bits")
    return int(text)


def _bad(reason: HintRejectReason, where: str, value: object, fix: str) -> HintRejected:
    return HintRejected(reason, f"{where} is {_describe(value)}: {fix}")


def _describe(value: object) -> str:
    """A short, bounded rendering of any value for error details (never a huge repr)."""
    if value is _MISSING:
        return "missing"
    if isinstance(value, (list, tuple, Mapping)):
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, str) and len(value) > 60:
        return f"{value[:57]!r}... ({len(value)} chars)"
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return repr(value) if value is None or isinstance(value, (str, int, float)) else \
        f"a {type(value).__name__}"


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _log_once(key: tuple[str, str], message: str, *args: object) -> None:
    """WARNING the first time this process sees `key` (at most 64 keys kept), DEBUG after."""
    with _warned_lock:
        first = key not in _warned and len(_warned) < _WARN_ONCE_MAX
        if first:
            _warned.add(key)
    _log.log(logging.WARNING if first else logging.DEBUG, message, *args)


class HintIntake:
    """The fail-open edge: a rejected hint is counted, logged and becomes None."""

    def __init__(self, metrics: HintOutcomeSink | None,
                 limits: HintLimits = DEFAULT_LIMITS) -> None:
        self.metrics = metrics
        self.limits = limits

    def accept(self, raw: object) -> KVHint | None:
        """The parsed hint, or None (rejected; or `raw` is None: no hint, not counted)."""
        if raw is None:
            return None
        try:
            hint = parse_hint(raw, self.limits)
        except HintRejected as exc:
            self._count(exc.reason.value)
            _log_once(("rejected", exc.reason.value), "%s; serving the request without the "
                      "hint (warned once per reason, later ones at DEBUG)", exc)
            return None
        self._count(HINT_ACCEPTED)
        versions = [("protocol_version", hint.protocol_version, PROTOCOL_VERSION)]
        versions += [(f"{f.action_type} action_version", f.action_version, FETCH_ACTION_VERSION)
                     for f in hint.fetches]
        for field, value, expected in versions:
            if value != expected:
                shown = value if len(value) <= 64 else f"{value[:61]}..."
                _log_once((field, shown), "kv_hint %s is %r but kvcr speaks %r; parsing it as "
                          "%r (warned once per value)", field, shown, expected, expected)
        return hint

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.hint_outcome(outcome)
