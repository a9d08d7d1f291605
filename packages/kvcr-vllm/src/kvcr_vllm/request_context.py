"""What a request's KV depends on beyond its token ids, as kvcr's keys carry it.

vLLM's own block hashes carry a request's cache salt, LoRA adapter, multimodal inputs and
prompt embeddings (`generate_block_hash_extra_keys`). kvcr's keys carry the first two in the
root of the request's key chain (`kvcr_core.keys.context_root`): requests of one salt, or of
one adapter, share KV across engines and nodes; of two, never.

- `cache_salt`: the salt itself.
- LoRA: the adapter's content, not its name or path (a name re-pointed at other weights, or
  one path holding other files on another node, must not share KV): a BLAKE2b-128 over every
  file of the adapter's local directory (relative path, size, bytes), hashed on a background
  thread (`LoraDigests`) once per version of its files (their sizes and mtimes, checked at
  each request). The first request of a new version waits up to `FIRST_WAIT_S` for it (a
  small adapter hashes in well under that); until its digest is known, requests of that
  adapter bypass kvcr (reason `lora`), as does one whose adapter is not a local directory
  kvcr can read: never a guess.
- Multimodal inputs: each block holding an input's placeholder tokens is keyed with the
  input's identifier (vLLM's content hash of it, or the client's `multi_modal_uuids`) and its
  offset in the block (`mm_block_extras`), as vLLM's own block hashes are, so two images
  behind the same placeholder tokens never share KV, and text before an image still shares
  with text-only prompts. An input without an identifier bypasses (`multimodal`).
- Prompt embeddings still bypass (`prompt_embeds`).

Threading: `request_context` on the scheduler's thread; `LoraDigests` hashes on its own
daemon thread, one adapter at a time, its table bounded (`MAX_ADAPTERS`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from kvcr_core.types import KEY_BYTES

log = logging.getLogger("kvcr_vllm")
MAX_ADAPTERS = 256
FIRST_WAIT_S = 0.05  # the scheduler waits this long for a new adapter's digest, once
MAX_ADAPTER_FILES = 4096
_READ = 1 << 20
Context = tuple[tuple[str, str], ...]


def adapter_digest(path: str) -> str:
    """Hex BLAKE2b-128 of an adapter directory's files. Raises OSError (not a readable
    directory) or ValueError (more than MAX_ADAPTER_FILES files)."""
    root = Path(path)
    if not root.is_dir():
        raise NotADirectoryError(f"{path} is not a local directory")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if len(files) > MAX_ADAPTER_FILES:
        raise ValueError(f"{path} holds more than {MAX_ADAPTER_FILES} files")
    h = hashlib.blake2b(b"kvcr-lora-adapter-v1\x00", digest_size=KEY_BYTES)
    for file in files:
        rel = file.relative_to(root).as_posix().encode("utf-8")
        h.update(len(rel).to_bytes(4, "little") + rel + file.stat().st_size.to_bytes(8, "little"))
        with file.open("rb") as f:
            while chunk := f.read(_READ):
                h.update(chunk)
    return h.hexdigest()


def adapter_signature(path: str) -> tuple[tuple[str, int, int], ...] | None:
    """(relative path, size, mtime ns) of every file of the adapter directory: what tells a
    cached digest from a stale one (an adapter rewritten in place); None if unreadable."""
    try:
        root = Path(path)
        return tuple(sorted((p.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns)
                            for p in root.rglob("*") if p.is_file() and (st := p.stat())))
    except OSError:
        return None


class LoraDigests:
    """Adapter path -> content digest, computed once per version of its files, off the
    scheduler's thread."""

    def __init__(self) -> None:
        self._known: OrderedDict[str, tuple[object, str | None]] = OrderedDict()
        self._queue: list[str] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        with self._cond:
            return len(self._known)

    def get(self, path: str, first_wait_s: float = 0.0) -> str | None:
        """The digest of the adapter's files as they are now, or None while it is computed
        or if it cannot be. A version of the files seen for the first time is queued, and
        this call waits up to `first_wait_s` for it (a small adapter is identified at its
        first request; a large one's requests bypass until it is)."""
        signature = adapter_signature(path)
        if signature is None:
            return None
        with self._cond:
            known = self._known.get(path)
            if known is not None and known[0] == signature:
                self._known.move_to_end(path)
                return known[1]
            if path in self._queue:
                return None
            self._queue.append(path)
            self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True,
                                                name="kvcr-lora-digests")
                self._thread.start()
            if first_wait_s <= 0 or not self._cond.wait_for(
                    lambda: path not in self._queue, first_wait_s):
                return None
            known = self._known.get(path)
        return known[1] if known is not None and known[0] == signature else None

    def wait(self, path: str, timeout_s: float) -> str | None:
        """`get`, waiting up to `timeout_s` for a queued digest (tests, warm-up)."""
        if self.get(path) is None:
            with self._cond:
                self._cond.wait_for(lambda: path not in self._queue, timeout_s)
        return self.get(path)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                path = self._queue[0]
            signature = adapter_signature(path)  # before the bytes: a later rewrite re-hashes
            try:
                digest: str | None = adapter_digest(path)
            except (OSError, ValueError) as exc:
                digest = None
                log.warning("kvcr: LoRA adapter %s cannot be identified by its files (%s); "
                            "its requests bypass kvcr (give vLLM a local adapter directory "
                            "to reuse their KV)", path, exc)
            with self._cond:
                self._queue.pop(0)
                self._known[path] = (signature, digest)
                self._known.move_to_end(path)
                while len(self._known) > MAX_ADAPTERS:
                    self._known.popitem(last=False)
                self._cond.notify_all()


def request_context(request: Any, lora: LoraDigests) -> tuple[Context, str | None]:
    """(the request's context for `context_root`, or the bypass reason when kvcr cannot name
    everything its KV depends on)."""
    if any(getattr(f, "identifier", None) is None
           for f in getattr(request, "mm_features", None) or ()):
        return (), "multimodal"
    if getattr(request, "prompt_embeds", None) is not None:
        return (), "prompt_embeds"
    context: list[tuple[str, str]] = []
    lora_request = getattr(request, "lora_request", None)
    if lora_request is not None:
        path = getattr(lora_request, "lora_path", None) or getattr(lora_request, "path", None)
        digest = lora.get(os.fspath(path), FIRST_WAIT_S) if path else None
        if digest is None:
            return (), "lora"
        context.append(("lora", digest))
    salt = getattr(request, "cache_salt", None)
    if salt:
        context.append(("cache_salt", str(salt)))
    return tuple(context), None


def mm_block_extras(request: Any, first: int, end: int, block_size: int
                    ) -> dict[int, tuple[tuple[str, str], ...]]:
    """For each block of [first, end) holding placeholder tokens of a multimodal input (key:
    its index from `first`): ("mm", "<input's identifier>:<the input's offset from the
    block's start>") per such input, in the request's order, as vLLM's block hashes carry
    them (kvcr_core.keys.block_keys_with)."""
    extras: dict[int, list[tuple[str, str]]] = {}
    for feature in getattr(request, "mm_features", None) or ():
        offset, length = feature.mm_position.offset, feature.mm_position.length
        for block in range(max(first, offset // block_size),
                           min(end, -(-(offset + length) // block_size))):
            extras.setdefault(block - first, []).append(
                ("mm", f"{feature.identifier}:{offset - block * block_size}"))
    return {block: tuple(pairs) for block, pairs in extras.items()}
