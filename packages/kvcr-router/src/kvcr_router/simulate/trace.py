"""Mooncake-style request traces (JSON Lines) in and out of the simulator.

One request per line: `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [int, ...]}`, the format of Mooncake's published traces (FAST'25), where each hash
id names one block of the prompt (512 tokens in Mooncake's traces) and equal ids mean an equal
prefix up to that block. Extra keys are ignored; blank lines are skipped; requests are replayed
in timestamp order (stable for equal timestamps). A bad line raises `TraceError` naming the
file, the line and the field. Reading is strict: a trace that half-loads would mislead a sweep.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvcr_core.errors import KVCRError
from kvcr_router.simulate.workload import SimRequest

MOONCAKE_BLOCK_TOKENS = 512
MAX_HASH_ID = 2**64 - 1


class TraceError(KVCRError, ValueError):
    """A trace line is unusable: names the file, the 1-based line and the field."""

    def __init__(self, path: str, line: int, field: str, problem: str) -> None:
        self.path = path
        self.line = line
        self.field = field
        super().__init__(f"{path}:{line}: field {field!r}: {problem}")


def read_trace(path: str | Path) -> list[SimRequest]:
    """Every request of the trace at `path`, in timestamp order."""
    name = str(path)
    out = []
    with open(path, encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if text.strip():
                out.append(_parse(name, number, text))
    out.sort(key=lambda r: r.arrival_ms)
    return out


def _parse(path: str, line: int, text: str) -> SimRequest:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError(path, line, "<line>", f"not JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise TraceError(path, line, "<line>", "expected a JSON object")

    def field(name: str) -> Any:
        if name not in record:
            raise TraceError(path, line, name, "missing")
        return record[name]

    timestamp = field("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or (
            not math.isfinite(timestamp)) or timestamp < 0:
        raise TraceError(path, line, "timestamp", f"{timestamp!r} is not a number of ms >= 0")
    lengths = []
    for name in ("input_length", "output_length"):
        value = field(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceError(path, line, name, f"{value!r} is not an integer >= 0")
        lengths.append(value)
    hash_ids = field("hash_ids")
    if not isinstance(hash_ids, list):
        raise TraceError(path, line, "hash_ids", "expected a list of integers")
    for i, h in enumerate(hash_ids):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID:
            raise TraceError(path, line, "hash_ids", f"item {i} ({h!r}) is not a u64 integer")
    return SimRequest(float(timestamp), lengths[0], lengths[1], tuple(hash_ids))


def write_trace(requests: Iterable[SimRequest], path: str | Path) -> None:
    """Writes `requests` in the same format (e.g. a synthetic workload, to replay elsewhere)."""
    with open(path, "w", encoding="utf-8") as out:
        for r in requests:
            out.write(json.dumps({"timestamp": r.arrival_ms, "input_length": r.input_tokens,
                                  "output_length": r.output_tokens,
                                  "hash_ids": list(r.hashes)}) + "\n")
