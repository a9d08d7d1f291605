"""The router's frozen configuration: workers, namespace, timeouts, weights, the tokenizing
bounds and who may see cache details (docs/router.md "Trust"), validated once.

`WorkerSpec.parse("a=http://10.0.0.1:8000,peer=tcp://10.0.0.1:7500")` reads one `--worker`
flag; `RouterConfig.from_mapping` reads the same fields from a YAML/JSON file or from the
command line (which overrides the file). Every bad value is a `ConfigError` naming the field
and the fix. Pure data; thread-safe (immutable).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvcr_core.endpoint import Endpoint
from kvcr_core.errors import ConfigError, HintRejected
from kvcr_core.keys import NamespaceSpec
from kvcr_router.cost import WEIGHT_PRESETS, CostWeights
from kvcr_router.hashing import MAX_PROMPT_CHARS

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")
MAX_WORKERS = 256
MAX_TOKENIZE_THREADS = 64


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One vLLM worker: its OpenAI URL, its kvcr peer endpoint (inventory + hint source) and,
    optionally, the ZMQ endpoint of vLLM's KV events (device tier)."""

    name: str  # a metrics label: short, fixed by the operator
    url: str  # http://host:port of the OpenAI server (no path)
    peer: str | None = None  # tcp://host:port where the worker's kvcr runner serves peers
    kv_events: str | None = None  # tcp://host:port of vLLM's KV event publisher

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ConfigError("worker.name", self.name,
                              "use 1-32 of a-z 0-9 _ . - (starting with a letter or digit)")
        parts = urlsplit(self.url) if isinstance(self.url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or (
                parts.path not in ("", "/")) or parts.query:
            raise ConfigError(f"worker {self.name}.url", self.url,
                              "give the server's base URL, e.g. http://10.0.0.7:8000")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        for field in ("peer", "kv_events"):
            value = getattr(self, field)
            if value is not None:
                try:
                    object.__setattr__(self, field, str(Endpoint.parse(value, where=field)))
                except HintRejected:
                    raise ConfigError(f"worker {self.name}.{field}", value,
                                      "give tcp://HOST:PORT") from None

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        """`NAME=URL[,peer=tcp://H:P][,kv_events=tcp://H:P]` (the `--worker` flag)."""
        name, sep, rest = text.partition("=")
        if not sep or not rest:
            raise ConfigError("worker", text, "write NAME=URL[,peer=tcp://H:P]"
                              "[,kv_events=tcp://H:P]")
        url, *options = rest.split(",")
        fields: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in ("peer", "kv_events") or key in fields:
                raise ConfigError(f"worker {name}", option,
                                  "options are peer=tcp://H:P and kv_events=tcp://H:P, once each")
            fields[key] = value.strip()
        return cls(name.strip(), url.strip(), **fields)

    @classmethod
    def from_mapping(cls, data: object) -> WorkerSpec:
        if isinstance(data, str):
            return cls.parse(data)
        if not isinstance(data, Mapping) or not {"name", "url"} <= set(data) or not set(
                data) <= {"name", "url", "peer", "kv_events"}:
            raise ConfigError("workers[]", data,
                              "give {name, url, peer?, kv_events?} or 'NAME=URL,peer=...'")
        return cls(**{str(k): v for k, v in data.items()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Everything `kvcr-router serve` needs. Defaults are the documented flag defaults."""

    workers: tuple[WorkerSpec, ...]
    namespace_digest: bytes  # the engines' (TP rank 0) kvcr namespace: keys start from it
    block_size: int  # tokens per block (the engines' --block-size)
    tokenizer: str | None = None  # a local tokenizer folder / hub id; None: token-id prompts only
    listen_host: str = "127.0.0.1"
    listen_port: int = 8000
    weights: CostWeights = dataclasses.field(default_factory=CostWeights)
    peer_secret_file: str | None = None
    peer_secret_env: str = "KVCR_PEER_SECRET"
    peer_node_key: str | None = None  # the router's fleet key file (with peer_fleet)
    peer_fleet: str | None = None  # the fleet file: it must list the router under `routers`
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    inventory_interval_s: float = 0.25
    inventory_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0  # the longest silence from a worker mid-response
    max_body_bytes: int = 32 * 1024 * 1024  # a longer body is refused (413) before it is read
    body_timeout_s: float = 10.0  # the whole body arrives within this, or 408 (bodies.py)
    json_threads: int = 1  # threads that decode and encode large bodies (4 pending per thread)
    max_blocks_per_source: int = 1_000_000
    # Trust: what a client may make the router compute, and who sees what the cache holds.
    trust_request_chat_template: bool = False  # render clients' chat_template(_kwargs)
    tokenize_threads: int = 2
    tokenize_timeout_s: float = 1.0  # a request waits no longer for its prompt's hashes
    max_pending_tokenize: int | None = None  # queued or running; None: 4 * tokenize_threads
    max_prompt_chars: int = MAX_PROMPT_CHARS  # longer prompt text (or render) is not encoded
    expose_cache_details: bool = False  # /kvcr/explain and x-kvcr-* headers for everyone
    # Or only for requests whose X-KVCR-Operator-Token header holds the operator token: read
    # from the file, else from the variable if it is set (access.py).
    operator_token_file: str | None = None
    operator_token_env: str = "KVCR_ROUTER_OPERATOR_TOKEN"

    def __post_init__(self) -> None:
        if not self.workers:
            raise ConfigError("workers", [], "give at least one --worker NAME=URL")
        if len(self.workers) > MAX_WORKERS:
            raise ConfigError("workers", len(self.workers), f"at most {MAX_WORKERS}")
        names = [w.name for w in self.workers]
        if len(set(names)) != len(names):
            raise ConfigError("workers", names, "give each worker a distinct name")
        if not isinstance(self.namespace_digest, bytes) or len(self.namespace_digest) != 16:
            raise ConfigError("namespace_digest", self.namespace_digest,
                              "give 16 bytes (32 hex digits), or a namespace spec")
        _positive_int("block_size", self.block_size)
        _positive_int("max_body_bytes", self.max_body_bytes)
        _positive_int("json_threads", self.json_threads)
        if self.json_threads > MAX_TOKENIZE_THREADS:
            raise ConfigError("json_threads", self.json_threads,
                              f"give at most {MAX_TOKENIZE_THREADS} threads")
        _positive_int("max_blocks_per_source", self.max_blocks_per_source)
        self._check_trust()
        if not isinstance(self.listen_port, int) or not 0 <= self.listen_port <= 65535:
            raise ConfigError("listen", self.listen_port, "give a port 0-65535")
        for field in ("health_interval_s", "health_timeout_s", "inventory_interval_s",
                      "inventory_timeout_s", "connect_timeout_s", "read_timeout_s",
                      "tokenize_timeout_s", "body_timeout_s"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or isinstance(value, bool) or not (
                    math.isfinite(value) and value > 0):
                raise ConfigError(field, value, "give a finite number of seconds > 0")

    @property
    def tokenize_pending_bound(self) -> int:
        """`max_pending_tokenize`, or 4 per tokenize thread when not set."""
        if self.max_pending_tokenize is None:
            return 4 * self.tokenize_threads
        return self.max_pending_tokenize

    def _check_trust(self) -> None:
        for field in ("trust_request_chat_template", "expose_cache_details"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(field, getattr(self, field), "give true or false")
        _positive_int("tokenize_threads", self.tokenize_threads)
        if self.tokenize_threads > MAX_TOKENIZE_THREADS:
            raise ConfigError("tokenize_threads", self.tokenize_threads,
                              f"give at most {MAX_TOKENIZE_THREADS} threads")
        if self.max_pending_tokenize is not None:
            _positive_int("max_pending_tokenize", self.max_pending_tokenize)
        _positive_int("max_prompt_chars", self.max_prompt_chars)
        if self.operator_token_file is not None and not (
                isinstance(self.operator_token_file, str) and self.operator_token_file):
            raise ConfigError("operator_token_file", self.operator_token_file,
                              "give the path of a file holding the operator token")
        if not isinstance(self.operator_token_env, str) or not self.operator_token_env:
            raise ConfigError("operator_token_env", self.operator_token_env,
                              "give the name of an environment variable")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> RouterConfig:
        """From flag-named fields (a config file's keys, or parsed flags); see docs/router.md."""
        data = dict(data)
        weights = {f.name: data.pop(f.name) for f in dataclasses.fields(CostWeights)
                   if data.get(f.name) is not None}
        preset = data.pop("weights_preset", None) or "reference"
        if preset not in WEIGHT_PRESETS:
            raise ConfigError("weights_preset", preset,
                              f"use one of {', '.join(WEIGHT_PRESETS)}")
        workers = data.pop("workers", None) or []
        if not isinstance(workers, list | tuple):
            raise ConfigError("workers", workers, "give a list of workers")
        digest = _namespace_digest(data.pop("namespace", None), data.pop("namespace_digest", None))
        block_size = data.pop("block_size", None)
        if block_size is None and isinstance(digest, NamespaceSpec):
            block_size = digest.block_size_tokens
        if isinstance(digest, NamespaceSpec):
            if block_size != digest.block_size_tokens:
                raise ConfigError("block_size", block_size,
                                  f"the namespace says {digest.block_size_tokens}; drop one")
            digest = digest.digest()
        if block_size is None:
            raise ConfigError("block_size", None, "give --block-size with --namespace-digest")
        listen = data.pop("listen", None)
        if listen is not None:
            data["listen_host"], data["listen_port"] = parse_listen(listen)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            raise ConfigError(unknown[0], data[unknown[0]],
                              "unknown field; see `kvcr-router serve --help`")
        return cls(workers=tuple(WorkerSpec.from_mapping(w) for w in workers),
                   namespace_digest=digest, block_size=block_size,
                   weights=dataclasses.replace(WEIGHT_PRESETS[preset], **weights),
                   **{k: v for k, v in data.items() if v is not None})


def parse_listen(text: object) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError("listen", text, "write HOST:PORT, e.g. 127.0.0.1:8000")
    return host.strip("[]"), int(port)


def read_config_file(path: str) -> dict[str, Any]:
    """A YAML or JSON object whose keys are the flag names (dashes or underscores)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("config", path, f"cannot read it ({exc.strerror})") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError("config", path, f"not valid JSON/YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("config", path, "the file must hold one mapping of flag names")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _namespace_digest(spec: object, digest: object) -> bytes | NamespaceSpec:
    if (spec is None) == (digest is None):
        raise ConfigError("namespace", spec or digest,
                          "give exactly one of --namespace (JSON/@FILE) or --namespace-digest")
    if digest is not None:
        try:
            raw = bytes.fromhex(str(digest))
        except ValueError:
            raw = b""
        if len(raw) != 16:
            raise ConfigError("namespace_digest", digest, "give 32 hex digits")
        return raw
    if isinstance(spec, NamespaceSpec):
        return spec
    if isinstance(spec, Mapping):
        return NamespaceSpec.from_mapping(spec)
    try:
        return NamespaceSpec.from_reference(str(spec))
    except OSError as exc:
        raise ConfigError("namespace", spec, f"cannot read it ({exc.strerror})") from None


def _positive_int(field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(field, value, "give a positive integer")
