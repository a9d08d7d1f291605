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

`HfTokenizer` is the one seam to `transformers` (imported lazily, when a tokenizer loads).
The front calls it from one executor thread (HF fast tokenizers are not safe to share
between threads that encode at once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from kvcr_core.errors import ConfigError
from kvcr_core.keys import block_keys, router_hash_kvcr_v1

PromptKind = Literal["completions", "chat"]
MAX_PROMPT_TOKENS = 1 << 20  # a larger prompt is routed without credit (bounded work)
_CHAT_OPTIONS = ("chat_template", "tools", "documents")


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
            self._tok: Any = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ConfigError("tokenizer", path, f"cannot load it: {exc}") from None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> str:
        return str(self._tok.apply_chat_template(messages, tokenize=False, **options))


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

    def tokens(self, kind: PromptKind, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine will see them, or None if unknown."""
        if body.get("cache_salt") is not None:
            return None  # kvcr bypasses salted requests: no block of theirs is shared
        tokens = self._completion(body) if kind == "completions" else self._chat(body)
        if tokens is None or len(tokens) > MAX_PROMPT_TOKENS:
            return None
        limit = body.get("truncate_prompt_tokens")
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < len(tokens):
            tokens = tokens[-limit:]  # vLLM keeps the prompt's end
        return tokens

    def _completion(self, body: Mapping[str, Any]) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not _is_token_list(prompt):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, list) and _is_token_list(prompt):
            return [int(t) for t in prompt]
        if isinstance(prompt, str) and self.tokenizer is not None:
            special = body.get("add_special_tokens", True)
            return self.tokenizer.encode(prompt, add_special_tokens=bool(special))
        return None

    def _chat(self, body: Mapping[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if self.tokenizer is None or not isinstance(messages, list) or not messages:
            return None
        conversation = []
        for message in messages:
            if not isinstance(message, Mapping):
                return None
            content = _text_content(message.get("content"))
            if content is None:
                return None
            conversation.append({**message, "content": content})
        final = bool(body.get("continue_final_message", False))
        options: dict[str, Any] = {
            "add_generation_prompt": bool(body.get("add_generation_prompt", not final)),
            "continue_final_message": final}
        options.update({k: body[k] for k in _CHAT_OPTIONS if body.get(k) is not None})
        extra = body.get("chat_template_kwargs")
        if isinstance(extra, Mapping):
            options.update({str(k): v for k, v in extra.items() if k != "tokenize"})
        try:
            text = self.tokenizer.render_chat(conversation, **options)
        except Exception:  # a template error: vLLM will answer it; route on load alone
            return None
        special = bool(body.get("add_special_tokens", False))
        return self.tokenizer.encode(text, add_special_tokens=special)


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
