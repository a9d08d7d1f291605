"""The Runner's settings: one frozen `KVCRConfig`, validated once at the edge (docs/config.md).

Owns the field set and defaults, the parsing of byte sizes and counts, and loading in layers:
defaults < config file (.json/.yaml/.yml) < environment (KVCR_<FIELD>) < explicit overrides.
Threading: a `KVCRConfig` is immutable and safe to share between threads. `load_config` reads
the file once and takes one snapshot of the environment; importing this module does nothing.
Contract: constructing a `KVCRConfig` either yields canonical values (sizes and counts as int,
`memory_backing` as the enum, built-in policy names lower-case, `log_level` upper-case) or
raises `ConfigError` naming the field, the bad value and the fix. Nothing downstream
re-validates these values; the import of a custom eviction policy is checked where it is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import keyword
import logging
import os
import re
from collections.abc import Iterable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvcr_core.errors import ConfigError

log = logging.getLogger("kvcr_core.config")
ENV_PREFIX = "KVCR_"
FOREIGN_ENV_VARS: frozenset[str] = frozenset({"KVCR_PEER_SECRET"})  # read by kvcr_core.peers
"""KVCR_* variables owned by other kvcr tools; `load_config` skips them instead of refusing."""

CONFIG_FILE_SECTION = "kvcr"
"""A file whose top level has this key is read from that key only (shared YAML files)."""

CONFIG_FILE_SUFFIXES = (".json", ".yaml", ".yml")
EVICTION_POLICIES = ("lru", "arc")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MIN_POOL_BYTES = 4096
MAX_HINT_ACTIONS_LIMIT = 64
MAX_SIZE_BYTES = (1 << 63) - 1  # mmap/ftruncate lengths are signed 64-bit

_UNIT_BYTES = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_UNIT_BYTES |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
# Digit runs are bounded so a hostile string cannot hit int()'s length limit or burn CPU.
_SIZE_RE = re.compile(r"\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([A-Za-z]*)\s*")
_COUNT_RE = re.compile(r"\s*[0-9]{1,30}\s*")
_SIZE_FIX = "give a size like 8GiB, 512MiB or a byte count"
_SIZE_UNITS = "units KiB, MiB, GiB, TiB (x1024) or KB, MB, GB, TB (x1000)"


class MemoryBacking(enum.Enum):
    """Where pool pages come from: a memfd sealed against resizing (shareable by fd: what
    kvcr-guard and embedded runners need) or anonymous mmap (in-process Runners only)."""

    MEMFD = "memfd"
    ANONYMOUS = "anonymous"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVCRConfig:
    """Every setting of the Runner. Build with `load_config` or `from_dict`; never mutated."""

    pool_bytes: int = 1 << 30
    """Total bytes of the host KV pool, across all namespaces (at least 4096)."""
    namespace_pool_bytes: int | None = None
    """Most bytes one namespace may take; None means the whole pool."""
    memory_backing: MemoryBacking = MemoryBacking.MEMFD
    """How the pool memory is allocated."""
    eviction_policy: str = "lru"
    """"lru", "arc" or "package.module:ClassName" of a custom policy."""
    max_reservations: int = 4096
    """Open write reservations at once; more raise CapacityError."""
    max_leases: int = 4096
    """Open read leases at once; more raise CapacityError."""
    max_hint_actions: int = 64
    """Actions accepted in one KV hint (1..64)."""
    max_hint_hashes: int = 65536
    """Entries accepted in one fetch action's `block_hashes` (each action on its own)."""
    max_hint_bytes: int = 1 << 20
    """Largest encoded KV hint accepted."""
    log_level: str = "INFO"
    """Threshold for kvcr's loggers."""
    verify_loads: bool | str = "auto"
    """Engines check each block they load against the checksum fixed at its commit (a block
    changed in the pool since then is recomputed, not used). Costs one xxh3 pass per load.
    "auto": in namespaces that processes of other uids map too (a shared tenant's)."""
    hash_threads: int | str = "auto"
    """Threads that hash an engine's saved blocks beside its copies (kvcr_core.sealing), so the
    engine's step never waits for a checksum. 0: hash in line, in the engine's thread.
    "auto": a quarter of the host's cores, 1 to 4."""

    def __post_init__(self) -> None:
        pool_bytes = parse_size_bytes("pool_bytes", self.pool_bytes, minimum=MIN_POOL_BYTES)
        namespace_pool_bytes = None
        if self.namespace_pool_bytes is not None:
            namespace_pool_bytes = parse_size_bytes(
                "namespace_pool_bytes", self.namespace_pool_bytes
            )
            if namespace_pool_bytes > pool_bytes:
                raise ConfigError(
                    "namespace_pool_bytes",
                    self.namespace_pool_bytes,
                    f"give at most pool_bytes ({pool_bytes} bytes), or leave it unset so one "
                    "namespace may use the whole pool",
                )
        canonical = {
            "pool_bytes": pool_bytes,
            "namespace_pool_bytes": namespace_pool_bytes,
            "memory_backing": _parse_memory_backing(self.memory_backing),
            "eviction_policy": _parse_eviction_policy(self.eviction_policy),
            "max_reservations": parse_count("max_reservations", self.max_reservations),
            "max_leases": parse_count("max_leases", self.max_leases),
            "max_hint_actions": parse_count(
                "max_hint_actions", self.max_hint_actions, maximum=MAX_HINT_ACTIONS_LIMIT
            ),
            "max_hint_hashes": parse_count("max_hint_hashes", self.max_hint_hashes),
            "max_hint_bytes": parse_size_bytes("max_hint_bytes", self.max_hint_bytes),
            "log_level": _parse_choice("log_level", self.log_level, LOG_LEVELS, upper=True),
            "verify_loads": _parse_verify_loads(self.verify_loads),
            "hash_threads": _parse_hash_threads(self.hash_threads),
        }
        for name, value in canonical.items():
            object.__setattr__(self, name, value)  # frozen: the only writes, before publication

    @property
    def effective_namespace_pool_bytes(self) -> int:
        """The per-namespace limit with the None default resolved to `pool_bytes`."""
        if self.namespace_pool_bytes is None:
            return self.pool_bytes
        return self.namespace_pool_bytes

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVCRConfig:
        """Build from a mapping of field names to raw values (as read from a file or a CLI)."""
        if not isinstance(data, Mapping):
            raise ConfigError("config", data, "give a mapping of field names to values")
        for key, value in data.items():
            if key not in FIELD_NAMES:
                raise _unknown_field(key, value, "")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field: sizes as ints, enums as their values."""
        out = {name: getattr(self, name) for name in FIELD_NAMES}
        out["memory_backing"] = self.memory_backing.value
        return out


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KVCRConfig))


def env_var_name(field: str) -> str:
    """The environment variable that sets `field`, e.g. KVCR_POOL_BYTES."""
    return ENV_PREFIX + field.upper()


def parse_size_bytes(field: str, value: object, *, minimum: int = 1) -> int:
    """An int, or a string like "8GiB", "1.5GB", "2 GiB", "4096", as a whole number of bytes."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(field, value, f"{_SIZE_FIX}, as an int or a string; {_SIZE_UNITS}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_RE.fullmatch(value)
        unit = _UNIT_BYTES.get(match.group(2).lower()) if match else None
        if match is None or unit is None:
            raise ConfigError(field, value, f"{_SIZE_FIX}; {_SIZE_UNITS}")
        exact = Fraction(match.group(1)) * unit
        if exact.denominator != 1:
            raise ConfigError(field, value, "give a size that comes to a whole number of bytes")
        size = int(exact)
    if not minimum <= size <= MAX_SIZE_BYTES:
        raise ConfigError(field, value, f"give a size of at least {minimum} bytes and below 8 EiB")
    return size


def parse_count(field: str, value: object, *, minimum: int = 1, maximum: int | None = None) -> int:
    """An int or a string of digits (environment variables are strings), within bounds."""
    count = int(value) if isinstance(value, str) and _COUNT_RE.fullmatch(value) else value
    bounds = f"from {minimum} to {maximum}" if maximum is not None else f"of at least {minimum}"
    if isinstance(count, bool) or not isinstance(count, int):
        raise ConfigError(field, value, f"give a whole number {bounds}, like 4096")
    if count < minimum or (maximum is not None and count > maximum):
        raise ConfigError(field, value, f"give a whole number {bounds}")
    return count


_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def parse_bool(field: str, value: object) -> bool:
    """A bool, or a string true/false, 1/0, yes/no, on/off (environment variables)."""
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ConfigError(field, value, "use true or false")


VERIFY_AUTO = "auto"
HASH_THREADS_AUTO = "auto"
MAX_HASH_THREADS = 64


def _parse_verify_loads(value: object) -> bool | str:
    if isinstance(value, str) and value.strip().lower() == VERIFY_AUTO:
        return VERIFY_AUTO
    try:
        return parse_bool("verify_loads", value)
    except ConfigError:
        raise ConfigError("verify_loads", value, "use auto (verify loads from namespaces other "
                          "uids share), true (always) or false (never)") from None


def _parse_hash_threads(value: object) -> int | str:
    if isinstance(value, str) and value.strip().lower() == HASH_THREADS_AUTO:
        return HASH_THREADS_AUTO
    try:
        return parse_count("hash_threads", value, minimum=0, maximum=MAX_HASH_THREADS)
    except ConfigError:
        raise ConfigError("hash_threads", value, "use auto (a quarter of the cores, 1 to 4), "
                          f"0 (hash in the engine's thread) or a count up to "
                          f"{MAX_HASH_THREADS}") from None


def verifies_loads(setting: bool | str, shared: bool) -> bool:
    """Whether an engine checks its loads from a namespace: `setting` is a config's
    `verify_loads`; `shared`: processes of other uids map that namespace too."""
    return setting is True or (setting == VERIFY_AUTO and shared)


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> KVCRConfig:
    """Resolve defaults < file at `path` < `env` (None: os.environ) < `overrides`."""
    return _resolve(path, env, overrides)[0]


def _resolve(
    path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None,
    overrides: Mapping[str, Any] | None,
) -> tuple[KVCRConfig, dict[str, str]]:
    entries: list[tuple[Any, Any, str]] = []
    if path is not None:
        where = f"file {os.fspath(path)}"
        entries += [(key, value, where) for key, value in _read_config_file(path).items()]
    entries += _env_entries(os.environ if env is None else env)
    entries += [(key, value, "override") for key, value in (overrides or {}).items()]
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, value, source in entries:
        if key not in FIELD_NAMES:
            raise _unknown_field(key, value, f" in {source}")
        merged[key] = value
        sources[key] = source
    try:
        config = KVCRConfig(**merged)
    except ConfigError as err:
        source = sources.get(err.field, "default")
        raise ConfigError(err.field, err.value, f"{err.fix} (set by {source})") from err
    return config, sources


def _env_entries(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """The KVCR_* variables that set fields. Others are not fatal: Kubernetes injects
    KVCR_GUARD_PORT, KVCR_ROUTER_SERVICE_HOST... into every pod of a namespace with such
    Services. Each is logged once, with the setting a typo may have meant."""
    entries = []
    for name, value in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name in FOREIGN_ENV_VARS:
            continue
        field = name[len(ENV_PREFIX) :].lower()
        if field not in FIELD_NAMES or name != env_var_name(field):
            _note_foreign(name)
            continue
        entries.append((field, value, f"environment {name}"))
    return entries


_noted: set[str] = set()


def _note_foreign(name: str) -> None:
    if name in _noted or len(_noted) > 256:
        return
    _noted.add(name)
    names = [env_var_name(f) for f in FIELD_NAMES]
    hint = _did_you_mean(name.upper(), names)
    log.warning("ignoring environment variable %s: not a kvcr setting%s", name, hint)


def _read_config_file(path: str | os.PathLike[str]) -> Mapping[Any, Any]:
    where = os.fspath(path)
    suffix = Path(where).suffix.lower()
    if suffix not in CONFIG_FILE_SUFFIXES:
        raise ConfigError("config_file", where, "use .json, .yaml or .yml")
    try:
        text = Path(where).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else str(err)
        raise ConfigError("config_file", where, f"cannot read it ({reason})") from err
    data = _parse_json(where, text) if suffix == ".json" else _parse_yaml(where, text)
    if isinstance(data, Mapping) and CONFIG_FILE_SECTION in data:
        data = data[CONFIG_FILE_SECTION]
    if data is None:  # an empty YAML file or an empty `kvcr:` section: all defaults
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            "config_file",
            where,
            f"the top level must be a mapping of field: value (or a '{CONFIG_FILE_SECTION}' "
            f"key holding one), not {type(data).__name__}",
        )
    return data


def _parse_json(where: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            "config_file", where, f"JSON parse error at line {err.lineno}: {err.msg}"
        ) from err


def _parse_yaml(where: str, text: str) -> Any:
    import yaml  # only YAML files need it; keeps `import kvcr_core` light

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError("config_file", where, f"YAML parse error{at}: {problem}") from err


def _parse_memory_backing(value: object) -> MemoryBacking:
    if isinstance(value, MemoryBacking):
        return value
    choices = [m.value for m in MemoryBacking]
    text = value.strip().lower() if isinstance(value, str) else ""
    if text in choices:
        return MemoryBacking(text)
    raise ConfigError(
        "memory_backing", value, f"use one of {', '.join(choices)}{_did_you_mean(text, choices)}"
    )


def _parse_eviction_policy(value: object) -> str:
    text = value.strip() if isinstance(value, str) else ""
    if text.lower() in EVICTION_POLICIES:
        return text.lower()
    module, colon, attr = text.partition(":")
    if colon and all(_is_identifier(part) for part in [*module.split("."), attr]):
        return text
    raise ConfigError(
        "eviction_policy",
        value,
        f"use one of {', '.join(EVICTION_POLICIES)} or 'package.module:ClassName'"
        f"{_did_you_mean(text.lower(), EVICTION_POLICIES)}",
    )


def _parse_choice(field: str, value: object, choices: Iterable[str], *, upper: bool = False) -> str:
    valid = tuple(choices)
    text = value.strip() if isinstance(value, str) else ""
    text = text.upper() if upper else text
    if text in valid:
        return text
    raise ConfigError(field, value, f"use one of {', '.join(valid)}{_did_you_mean(text, valid)}")


def _is_identifier(text: str) -> bool:
    return text.isidentifier() and not keyword.iskeyword(text)


def _unknown_field(key: object, value: object, where: str) -> ConfigError:
    name = str(key)
    return ConfigError(
        name,
        value,
        f"not a kvcr config field{where}{_did_you_mean(name, FIELD_NAMES)}; "
        f"valid fields: {', '.join(FIELD_NAMES)}",
    )


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
