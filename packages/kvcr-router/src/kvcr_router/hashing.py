"""Prompt -> token ids -> kvcr router hashes, exactly as the connectors compute them.

`PromptHasher.tokens(kind, body)` reproduces what vLLM's OpenAI server feeds the engine:
`/v1/completions` encodes a text prompt with `add_special_tokens` (default true) or takes
token ids as given; `/v1/chat/completions` renders the model's chat template
(`add_generation_prompt` default true, text parts of a message joined by newlines as vLLM's
"string" content format does) and encodes the text without special tokens (the template
adds them). `PromptHasher.hashes(tokens)` chains kvcr block keys from the namespace digest
(docs/keys.md) and projects them with `kvcr-v1`. A prompt the router cannot reproduce
(images, `cache_salt`, no tokenizer) gives None: the request is routed on load alone.
A wrong guess only costs credit, never correctness (the worker matches hashes itself).
Work is bounded by `max_chars`: a prompt whose text (or rendered chat) is longer, or that
has more than 2^20 tokens, raises `PromptTooLarge` instead of being encoded. Whether a
client's own `chat_template` may be rendered at all is the caller's policy (tokenizing.py).

`HfTokenizer` is the one seam to `transformers` (imported lazily, when a tokenizer loads).
Thread-safe: each thread encodes with its own copy of the loaded tokenizer (HF fast
tokenizers must not encode concurrently on one instance: "Already borrowed").
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from kvcr_core.errors import ConfigError
from kvcr_core.keys import block_keys, router_hash_kvcr_v1

PromptKind = Literal["completions", "chat"]
MAX_PROMPT_TOKENS = 1 << 20  # a larger prompt is routed without credit (bounded work)
MAX_PROMPT_CHARS = 4 << 20  # the default bound on text handed to the tokenizer
_CHAT_OPTIONS = ("chat_template", "tools", "documents")
_CHAT_DATA = ("tools", "documents")  # rendered by the template: counted into its input size


class PromptTooLarge(Exception):
    """The prompt's text, rendered chat or tokens exceed the bound: route it on load alone."""


class PromptTokenizer(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> str: ...


class HfTokenizer:
    """A Hugging Face tokenizer (the model folder vLLM serves, or its `--tokenizer`)."""

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("tokenizer", path, "install transformers "
                              "(`pip install transformers`) or route token-id prompts "
                              "only (no --tokenizer)") from None
        try:
            self._loaded: Any = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ConfigError("tokenizer", path, f"cannot load it: {exc}") from None
        self._copy_lock = threading.Lock()
        self._local = threading.local()

    def _tok(self) -> Any:
        """This thread's copy (the loaded one is only ever copied, never used to encode)."""
        tok = getattr(self._local, "tok", None)
        if tok is None:
            with self._copy_lock:
                tok = copy.deepcopy(self._loaded)
            self._local.tok = tok
        return tok

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tok().encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> str:
        return str(self._tok().apply_chat_template(messages, tokenize=False, **options))


class PromptHasher:
    def __init__(self, namespace_digest: bytes, block_size: int,
                 tokenizer: PromptTokenizer | None = None) -> None:
        self.namespace_digest = bytes(namespace_digest)
        self.block_size = block_size
        self.tokenizer = tokenizer

    def hashes(self, tokens: Sequence[int]) -> list[int]:
        """Router hashes (`kvcr-v1`) of every full block of `tokens`."""
        keys = block_keys(self.namespace_digest, tokens, self.block_size)
        return [router_hash_kvcr_v1(k) for k in keys]

    def tokens(self, kind: PromptKind, body: Mapping[str, Any],
               max_chars: int | None = None) -> list[int] | None:
        """The prompt's token ids as the engine will see them, or None if unknown. Raises
        `PromptTooLarge` past `max_chars` of text or `MAX_PROMPT_TOKENS` tokens, and whatever
        the tokenizer or template raises."""
        if body.get("cache_salt") is not None:
            return None  # its keys are rooted in the salt (docs/keys.md): not reproduced here
        limit_chars = MAX_PROMPT_CHARS if max_chars is None else max_chars
        tokens = (self._completion(body, limit_chars) if kind == "completions"
                  else self._chat(body, limit_chars))
        if tokens is None:
            return None
        if len(tokens) > MAX_PROMPT_TOKENS:
            raise PromptTooLarge(f"{len(tokens)} tokens")
        limit = body.get("truncate_prompt_tokens")
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < len(tokens):
            tokens = tokens[-limit:]  # vLLM keeps the prompt's end
        return tokens

    def _completion(self, body: Mapping[str, Any], max_chars: int) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPT_TOKENS:
            raise PromptTooLarge(f"{len(prompt)} prompt items")  # before looking at each
        if isinstance(prompt, list) and prompt and not _is_token_list(prompt):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, list) and _is_token_list(prompt):
            return [int(t) for t in prompt]
        if isinstance(prompt, str) and self.tokenizer is not None:
            _check_chars(len(prompt), max_chars)
            special = body.get("add_special_tokens", True)
            return self.tokenizer.encode(prompt, add_special_tokens=bool(special))
        return None

    def _chat(self, body: Mapping[str, Any], max_chars: int) -> list[int] | None:
        messages = body.get("messages")
        if self.tokenizer is None or not isinstance(messages, list) or not messages:
            return None
        conversation = []
        chars = sum(len(json.dumps(body[k])) for k in _CHAT_DATA if body.get(k) is not None)
        for message in messages:
            if not isinstance(message, Mapping):
                return None
            content = _text_content(message.get("content"))
            if content is None:
                return None
            chars += len(content)
            _check_chars(chars, max_chars)
            conversation.append({**message, "content": content})
        final = bool(body.get("continue_final_message", False))
        options: dict[str, Any] = {
            "add_generation_prompt": bool(body.get("add_generation_prompt", not final)),
            "continue_final_message": final}
        options.update({k: body[k] for k in _CHAT_OPTIONS if body.get(k) is not None})
        extra = body.get("chat_template_kwargs")
        if isinstance(extra, Mapping):
            options.update({str(k): v for k, v in extra.items() if k != "tokenize"})
        text = self.tokenizer.render_chat(conversation, **options)
        _check_chars(len(text), max_chars)  # a template can multiply its input
        special = bool(body.get("add_special_tokens", False))
        return self.tokenizer.encode(text, add_special_tokens=special)


def _check_chars(chars: int, max_chars: int) -> None:
    if chars > max_chars:
        raise PromptTooLarge(f"over {max_chars} characters")


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in value)


def _text_content(content: object) -> str | None:
    """A message's text: a string, or text parts joined by newlines; None if not all text."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(
                part.get("text"), str):
            return None
        texts.append(part["text"])
    return "\n".join(texts)
