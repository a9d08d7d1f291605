"""Prompt hashes for the front, with bounded work: no request waits on another's prompt.

`TokenizePool.hash(route, body)` answers a `Hashed`: the prompt's router hashes, or none and
the reason (`UNHASHED_REASONS`), in which case the request is routed on load alone (it still
goes through unchanged; only KV credit is lost):

- `request_template`: a chat request carries its own `chat_template` or
  `chat_template_kwargs` and the operator did not pass `--trust-request-chat-template` (a
  client's template is code: a few hundred bytes of nested loops can run for seconds).
  `tools` and `documents` are data for the model's own template and are rendered.
- `busy`: `max_pending` tokenizations are already queued or running; answered at once.
- `deadline`: no answer within `timeout_s` (counted from submission). The thread finishes in
  the background and its result is dropped; until then it counts as pending.
- `too_large`: the prompt's text or rendered chat is over `max_prompt_chars`, or its tokens
  over 2^20 (hashing.py); `tokenizer_error`: the tokenizer or template raised (vLLM answers
  the request itself); `unsupported`: no tokenizer for text, non-text parts, `cache_salt`.

Threading: `hash` and the pending count belong to the event loop. `threads` daemon threads
run the tokenizer and hand results back with `call_soon_threadsafe` (daemons, so that a
render still running cannot hold up the process's exit); `HfTokenizer` gives each thread its
own copy. Nothing here touches the index or the metrics: the front counts the reasons.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kvcr_router.hashing import PromptHasher, PromptKind, PromptTooLarge

log = logging.getLogger("kvcr_router")
UNHASHED_REASONS = ("request_template", "busy", "deadline", "too_large", "tokenizer_error",
                    "unsupported")


@dataclasses.dataclass(frozen=True)
class Hashed:
    hashes: list[int]
    tokens: int
    unhashed: str | None = None  # one of UNHASHED_REASONS, or None: hashed


_Job = tuple[Callable[[], Hashed], Callable[[Hashed], None]]


def carries_request_template(route: PromptKind, body: Mapping[str, Any]) -> bool:
    return route == "chat" and (body.get("chat_template") is not None
                                or body.get("chat_template_kwargs") is not None)


class TokenizePool:
    def __init__(self, hasher: PromptHasher, *, threads: int, timeout_s: float,
                 max_pending: int, max_prompt_chars: int,
                 trust_request_chat_template: bool = False) -> None:
        self.hasher = hasher
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.max_prompt_chars = max_prompt_chars
        self.trust_request_chat_template = trust_request_chat_template
        self.pending = 0  # submitted and not yet finished, timed out or not
        self._threads = threads
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._started: list[threading.Thread] = []

    async def hash(self, route: PromptKind, body: Mapping[str, Any]) -> Hashed:
        if not self.trust_request_chat_template and carries_request_template(route, body):
            return Hashed([], 0, "request_template")
        if self.pending >= self.max_pending:
            return Hashed([], 0, "busy")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Hashed] = loop.create_future()

        def done(result: Hashed) -> None:  # on the loop
            self.pending -= 1
            if not future.done():
                future.set_result(result)

        def deliver(result: Hashed) -> None:  # on the worker thread
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(done, result)

        self._start()
        self.pending += 1
        self._jobs.put((lambda: self._work(route, body), deliver))
        finished, _ = await asyncio.wait({future}, timeout=self.timeout_s)
        return future.result() if finished else Hashed([], 0, "deadline")

    def close(self) -> None:
        """Ends the idle threads; a thread still tokenizing ends when that job does."""
        for _ in self._started:
            self._jobs.put(None)
        self._started = []

    def _start(self) -> None:
        while len(self._started) < self._threads:
            thread = threading.Thread(target=self._serve, daemon=True,
                                      name=f"kvcr-router-tokenize-{len(self._started)}")
            thread.start()
            self._started.append(thread)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, deliver = job
            deliver(work())

    def _work(self, route: PromptKind, body: Mapping[str, Any]) -> Hashed:
        try:
            tokens = self.hasher.tokens(route, body, self.max_prompt_chars)
            if tokens is None:
                return Hashed([], 0, "unsupported")
            return Hashed(self.hasher.hashes(tokens), len(tokens))
        except PromptTooLarge:
            return Hashed([], 0, "too_large")
        except Exception as exc:  # a client's template or a tokenizer fault: route on load
            log.debug("tokenizing a %s prompt failed: %s", route, exc, exc_info=True)
            return Hashed([], 0, "tokenizer_error")
