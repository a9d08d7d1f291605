"""Request bodies for the front: read within a size limit and one deadline for the whole body,
and large JSON decoded and encoded on a bounded pool of threads, never in one piece on the
event loop.

`read_body(request, max_bytes, deadline_s)` answers the body's bytes or raises `BodyRefused`:
`too_large` (413) as soon as the declared `Content-Length` or the bytes received pass
`max_bytes`, before the rest is read; `deadline` (408) when the whole body has not arrived
within `deadline_s` of the handler's start (a slow-body client cannot hold a connection
open). `JsonCodec.loads` raises `bad_json` (400) or `busy` (503: `max_pending` large bodies
are already being decoded or encoded; answered at once). `BODY_REFUSALS` is the bounded label.

Why threads and hooks: CPython's JSON scanner and encoder hold the GIL for a whole call, so
a 30 MB body decoded in a thread would still stall the loop for its whole 0.3-0.5 s. Large
bodies are decoded with Python-level hooks for numbers and objects (each one a point where
the loop can take the GIL) and encoded in slices of `_SLICE_ITEMS` list items, so the loop
waits at most tens of milliseconds at a time; bodies up to `INLINE_BYTES` stay on the loop,
where they cost less than the hand-off. One long JSON string is still one call (~10 ms per
5 MB, bounded by `max_bytes`).
Threading: `read_body` and the codec's pending count belong to the event loop; the pool's
threads only run `_decode` / `_encode` on values no other code touches meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

BODY_REFUSALS = ("too_large", "deadline", "bad_json", "busy")
INLINE_BYTES = 64 * 1024
_SLICE_ITEMS = 4096
_STATUS = {"too_large": 413, "deadline": 408, "bad_json": 400, "busy": 503}
T = TypeVar("T")


class BodyRefused(Exception):
    """The body was not taken: `reason` (one of `BODY_REFUSALS`), its HTTP `status`, and
    whether the connection must close (the rest of the body was never read)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = _STATUS[reason]
        self.close = reason in ("too_large", "deadline")


async def read_body(request: web.Request, max_bytes: int, deadline_s: float) -> bytes:
    """The whole body, or `BodyRefused` (too_large / deadline) without reading the rest."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise BodyRefused("too_large", f"the body is {declared} bytes; the limit is "
                                       f"{max_bytes} (--max-body-bytes)")
    body = bytearray()
    try:
        async with asyncio.timeout(deadline_s):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > max_bytes:
                    raise BodyRefused("too_large", f"the body passed the limit of {max_bytes} "
                                                   "bytes (--max-body-bytes)")
    except TimeoutError:
        raise BodyRefused("deadline", f"the body did not arrive within {deadline_s:g} s "
                                      "(--body-timeout-s)") from None
    return bytes(body)


class JsonCodec:
    """JSON for request bodies: small ones on the loop, large ones on `threads` threads with at
    most `max_pending` of them queued or running."""

    def __init__(self, *, threads: int, max_pending: int) -> None:
        self.max_pending = max_pending
        self.pending = 0
        self._pool = ThreadPoolExecutor(threads, "kvcr-router-json")

    async def loads(self, raw: bytes) -> object:
        """The decoded body; `BodyRefused` bad_json (not UTF-8 JSON) or busy."""
        if len(raw) <= INLINE_BYTES:
            return _decode_inline(raw)
        if self.pending >= self.max_pending:
            raise BodyRefused("busy", "too many large bodies are being decoded; retry later")
        return await self._run(_decode, raw)

    async def dumps(self, value: dict[str, Any], size_hint: int) -> bytes:
        """`value` as JSON bytes; `size_hint`: the bytes it came from (large: a thread)."""
        if size_hint <= INLINE_BYTES:
            return json.dumps(value).encode()
        return await self._run(_encode, value)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, work: Callable[[Any], T], arg: Any) -> T:
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, work, arg)
        finally:
            self.pending -= 1


def _decode_inline(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BodyRefused("bad_json", "the body must be a JSON object") from None


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


_YIELDING = json.JSONDecoder(parse_int=_int, parse_float=_float, object_pairs_hook=_object)


def _decode(raw: bytes) -> object:
    try:
        return _YIELDING.decode(raw.decode())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BodyRefused("bad_json", "the body must be a JSON object") from None


def _encode(value: Any) -> bytes:
    out: list[str] = []
    _encode_into(value, out)
    return "".join(out).encode()


def _encode_into(value: Any, out: list[str]) -> None:
    """`json.dumps(value)`'s text, from calls of about `_SLICE_ITEMS` values each at most."""
    if isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(f"{', ' if i else ''}{json.dumps(key)}: ")
            _encode_into(item, out)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        start = weight = 0
        for i, item in enumerate(value):
            size = len(item) if isinstance(item, list | dict) else 1
            if size > _SLICE_ITEMS:  # a large container alone, recursively
                _encode_slice(value[start:i], out)
                if out[-1] != "[":
                    out.append(", ")
                _encode_into(item, out)
                start, weight = i + 1, 0
            elif (weight := weight + size) >= _SLICE_ITEMS:
                _encode_slice(value[start:i + 1], out)
                start, weight = i + 1, 0
        _encode_slice(value[start:], out)
        out.append("]")
    else:
        out.append(json.dumps(value))


def _encode_slice(items: list[Any], out: list[str]) -> None:
    if items:
        if out[-1] != "[":
            out.append(", ")
        out.append(json.dumps(items)[1:-1])
