"""KVCRConfig: defaults, validation of every field, size parsing and layered loading."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcr_core import config as config_module
from kvcr_core.config import (
    FIELD_NAMES,
    KVCRConfig,
    MemoryBacking,
    env_var_name,
    load_config,
    parse_count,
    parse_size_bytes,
)
from kvcr_core.errors import ConfigError

pytestmark = pytest.mark.unit

GiB = 1 << 30
MiB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[3]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults() -> None:
    """The documented defaults are what an empty config resolves to."""
    cfg = load_config(env={})
    assert cfg == KVCRConfig()
    assert cfg.to_dict() == {
        "pool_bytes": GiB,
        "namespace_pool_bytes": None,
        "memory_backing": "memfd",
        "eviction_policy": "lru",
        "max_reservations": 4096,
        "max_leases": 4096,
        "max_hint_actions": 64,
        "max_hint_hashes": 65536,
        "max_hint_bytes": MiB,
        "log_level": "INFO",
        "verify_loads": "auto",
        "hash_threads": "auto",
    }
    assert cfg.memory_backing is MemoryBacking.MEMFD
    assert cfg.effective_namespace_pool_bytes == GiB


def test_frozen() -> None:
    """A config cannot be changed after validation (assignment raises)."""
    cfg = KVCRConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.pool_bytes = 1  # type: ignore[misc]
    assert cfg.pool_bytes == GiB


def test_keyword_only() -> None:
    """Positional construction is refused, so a field reorder cannot silently swap values."""
    with pytest.raises(TypeError):
        KVCRConfig(GiB)  # type: ignore[misc]


def test_values_are_canonicalised() -> None:
    """Raw strings (as from env or YAML) become ints, the enum, lower/upper-case names."""
    cfg = KVCRConfig.from_dict(
        {
            "pool_bytes": "8GiB",
            "namespace_pool_bytes": "2 GiB",
            "memory_backing": "ANONYMOUS",
            "eviction_policy": "ARC",
            "max_reservations": "12",
            "max_leases": " 7 ",
            "max_hint_actions": "1",
            "max_hint_hashes": 10,
            "max_hint_bytes": "64KiB",
            "log_level": "debug",
        }
    )
    assert cfg.pool_bytes == 8 * GiB
    assert cfg.namespace_pool_bytes == cfg.effective_namespace_pool_bytes == 2 * GiB
    assert cfg.memory_backing is MemoryBacking.ANONYMOUS
    assert cfg.eviction_policy == "arc"
    assert (cfg.max_reservations, cfg.max_leases, cfg.max_hint_actions) == (12, 7, 1)
    assert cfg.max_hint_bytes == 64 * 1024
    assert cfg.log_level == "DEBUG"


def test_custom_eviction_policy_path_kept_verbatim() -> None:
    """A 'package.module:ClassName' policy passes syntax validation unchanged."""
    cfg = KVCRConfig(eviction_policy="my_pkg.policies:SizeAwarePolicy")
    assert cfg.eviction_policy == "my_pkg.policies:SizeAwarePolicy"


def test_to_dict_round_trips_through_json() -> None:
    """to_dict is JSON-safe and from_dict(to_dict()) rebuilds an equal config."""
    cfg = KVCRConfig(pool_bytes="2GiB", namespace_pool_bytes="1GiB", memory_backing="anonymous")
    data = json.loads(json.dumps(cfg.to_dict()))
    assert KVCRConfig.from_dict(data) == cfg


INVALID_VALUES: list[tuple[str, Any]] = [
    ("pool_bytes", "8 GB/s"),
    ("pool_bytes", 4095),
    ("pool_bytes", "4KB"),
    ("pool_bytes", 0),
    ("pool_bytes", -1),
    ("pool_bytes", True),
    ("pool_bytes", 1.5e9),
    ("pool_bytes", None),
    ("namespace_pool_bytes", "lots"),
    ("namespace_pool_bytes", 0),
    ("namespace_pool_bytes", False),
    ("memory_backing", "hugepages"),
    ("memory_backing", 1),
    ("eviction_policy", "fifo"),
    ("eviction_policy", "my_pkg.policies"),
    ("eviction_policy", "my_pkg:"),
    ("eviction_policy", ":Policy"),
    ("eviction_policy", "my_pkg..x:Policy"),
    ("eviction_policy", "my-pkg:Policy"),
    ("eviction_policy", "my_pkg:1Policy"),
    ("eviction_policy", "class:Policy"),
    ("eviction_policy", "a:b:C"),
    ("eviction_policy", 3),
    ("max_reservations", 0),
    ("max_reservations", "many"),
    ("max_reservations", True),
    ("max_reservations", 2.0),
    ("max_leases", 0),
    ("max_leases", "-3"),
    ("max_hint_actions", 0),
    ("max_hint_actions", 65),
    ("max_hint_actions", "65"),
    ("max_hint_hashes", 0),
    ("max_hint_hashes", "1e6"),
    ("max_hint_bytes", 0),
    ("max_hint_bytes", "1 MiB/s"),
    ("log_level", "verbose"),
    ("log_level", 10),
    ("verify_loads", "maybe"),
    ("verify_loads", 1),
    ("hash_threads", "many"),
    ("hash_threads", -1),
    ("hash_threads", 65),
    ("hash_threads", True),
]


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), (" AUTO ", "auto"), (0, 0),
                                                 ("3", 3), (64, 64)])
def test_hash_threads_accepts_auto_and_counts(value: object, expected: object) -> None:
    """`hash_threads` takes auto or a count from 0 (in line) to 64, from a file or env."""
    assert KVCRConfig.from_dict({"hash_threads": value}).hash_threads == expected


@pytest.mark.parametrize(("field", "value"), INVALID_VALUES)
def test_invalid_value_names_field_and_value(field: str, value: Any) -> None:
    """Every bad value raises ConfigError naming that field and showing the value."""
    with pytest.raises(ConfigError) as info:
        KVCRConfig.from_dict({field: value})
    assert info.value.field == field
    assert info.value.value == value
    assert repr(value) in str(info.value)
    assert info.value.fix


def test_every_field_has_an_invalid_case() -> None:
    """A new field cannot be added without a rejection test in INVALID_VALUES."""
    assert {field for field, _ in INVALID_VALUES} == set(FIELD_NAMES)


def test_error_lists_valid_choices() -> None:
    """Choice errors tell the user the valid values, with a close match suggested."""
    with pytest.raises(ConfigError, match="anonymous"):
        KVCRConfig(memory_backing="anonymus")
    with pytest.raises(ConfigError, match=r"did you mean 'INFO'"):
        KVCRConfig(log_level="INFOO")
    with pytest.raises(ConfigError, match=r"did you mean 'lru'"):
        KVCRConfig(eviction_policy="lur")


def test_namespace_pool_larger_than_pool_refused() -> None:
    """One namespace may not be allowed more than the whole pool."""
    with pytest.raises(ConfigError) as info:
        KVCRConfig(pool_bytes="1GiB", namespace_pool_bytes="2GiB")
    assert info.value.field == "namespace_pool_bytes"
    assert "pool_bytes" in info.value.fix
    assert KVCRConfig(pool_bytes="1GiB", namespace_pool_bytes=GiB).namespace_pool_bytes == GiB


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * GiB),
        ("512MiB", 512 * MiB),
        ("64KiB", 64 * 1024),
        ("1.5GB", 1_500_000_000),
        ("100MB", 100_000_000),
        ("4096", 4096),
        ("2 GiB", 2 * GiB),
        ("8gib", 8 * GiB),
        ("1kb", 1000),
        ("1TiB", 1 << 40),
        ("3TB", 3 * 10**12),
        ("1.5KiB", 1536),
        (" 4096B ", 4096),
        ("4096.0", 4096),
        (4096, 4096),
    ],
)
def test_size_parsing(text: str | int, expected: int) -> None:
    """Binary and decimal units, spaces and case variants convert to exact byte counts."""
    assert parse_size_bytes("pool_bytes", text) == expected


@pytest.mark.parametrize(
    "text",
    ["8 GB/s", "8G", "8 EiB", "1.3KiB", "0.5", "-1GiB", "", "GiB", "1e9", "1,024", "0", "9" * 40],
)
def test_size_parsing_refuses(text: str) -> None:
    """Unknown units, fractional bytes, signs, empty and absurdly long strings are refused."""
    with pytest.raises(ConfigError) as info:
        parse_size_bytes("max_hint_bytes", text)
    assert info.value.field == "max_hint_bytes"


def test_size_upper_bound() -> None:
    """Sizes beyond a signed 64-bit length are refused rather than failing in mmap later."""
    assert parse_size_bytes("pool_bytes", (1 << 63) - 1) == (1 << 63) - 1
    with pytest.raises(ConfigError):
        parse_size_bytes("pool_bytes", "8388608TiB")


@given(st.integers(min_value=1, max_value=1 << 40))
def test_size_units_scale_exactly(n: int) -> None:
    """For any n, "n", "nKiB" and "nKB" parse to n, n*1024 and n*1000 bytes."""
    assert parse_size_bytes("x", str(n)) == n
    assert parse_size_bytes("x", f"{n}KiB") == n * 1024
    assert parse_size_bytes("x", f"{n} KB") == n * 1000


def test_count_parsing() -> None:
    """Counts take ints or digit strings and enforce their bounds; bools and floats refused."""
    assert parse_count("max_leases", "4096") == 4096
    assert parse_count("max_hint_actions", 64, maximum=64) == 64
    for bad in ["4k", "1.0", "", "9" * 40, True, 2.5]:
        with pytest.raises(ConfigError):
            parse_count("max_leases", bad)


def test_unknown_key_suggests_field() -> None:
    """A misspelt key is refused with a did-you-mean and the list of valid fields."""
    with pytest.raises(ConfigError) as info:
        KVCRConfig.from_dict({"pool_byte": "8GiB"})
    assert info.value.field == "pool_byte"
    assert "did you mean 'pool_bytes'" in info.value.fix
    assert all(name in info.value.fix for name in FIELD_NAMES)


def test_from_dict_refuses_non_mapping() -> None:
    """A list or scalar where a mapping belongs is a ConfigError, not a TypeError."""
    with pytest.raises(ConfigError):
        KVCRConfig.from_dict(["pool_bytes"])  # type: ignore[arg-type]


def test_yaml_file(tmp_path: Path) -> None:
    """A YAML file's values are parsed and validated."""
    path = write(tmp_path / "kvcr.yaml", "pool_bytes: 8GiB\nmax_leases: 10\nlog_level: warning\n")
    cfg = load_config(path, env={})
    assert (cfg.pool_bytes, cfg.max_leases, cfg.log_level) == (8 * GiB, 10, "WARNING")


def test_json_file(tmp_path: Path) -> None:
    """A JSON file's values are parsed and validated (str path accepted too)."""
    path = write(tmp_path / "kvcr.json", json.dumps({"pool_bytes": 2 * GiB, "max_leases": 3}))
    cfg = load_config(str(path), env={})
    assert (cfg.pool_bytes, cfg.max_leases) == (2 * GiB, 3)


def test_nested_kvcr_section(tmp_path: Path) -> None:
    """A shared file's top-level 'kvcr' section is read and its siblings are ignored."""
    path = write(
        tmp_path / "stack.yml",
        "router:\n  port: 8000\nkvcr:\n  pool_bytes: 4GiB\n  eviction_policy: arc\n",
    )
    cfg = load_config(path, env={})
    assert (cfg.pool_bytes, cfg.eviction_policy) == (4 * GiB, "arc")


@pytest.mark.parametrize("text", ["", "# only comments\n", "kvcr:\n"])
def test_empty_yaml_means_defaults(tmp_path: Path, text: str) -> None:
    """An empty YAML file or empty 'kvcr:' section resolves to the defaults."""
    assert load_config(write(tmp_path / "kvcr.yaml", text), env={}) == KVCRConfig()


def test_unknown_key_in_file_names_file(tmp_path: Path) -> None:
    """An unknown key in a file says which file and suggests the field."""
    path = write(tmp_path / "kvcr.yaml", "max_lease: 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.field == "max_lease"
    assert str(path) in info.value.fix
    assert "did you mean 'max_leases'" in info.value.fix


def test_bad_value_in_file_names_source(tmp_path: Path) -> None:
    """A bad file value names the field and the file it came from."""
    path = write(tmp_path / "kvcr.yaml", "pool_bytes: 8 GB/s\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.field == "pool_bytes"
    assert info.value.value == "8 GB/s"
    assert str(path) in info.value.fix


@pytest.mark.parametrize("name", ["kvcr.toml", "kvcr", "kvcr.ini"])
def test_unsupported_extension(tmp_path: Path, name: str) -> None:
    """Only .json, .yaml and .yml are read; anything else says which to use."""
    path = write(tmp_path / name, "pool_bytes = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.field == "config_file"
    assert info.value.fix == "use .json, .yaml or .yml"


def test_missing_file(tmp_path: Path) -> None:
    """A missing file is a ConfigError naming the path, not a bare OSError."""
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.field == "config_file"
    assert str(path) in str(info.value)


def test_json_parse_error_names_line(tmp_path: Path) -> None:
    """A JSON syntax error reports the file and the line it is on."""
    path = write(tmp_path / "kvcr.json", '{\n  "pool_bytes": 1,\n  "max_leases": ,\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.field == "config_file"
    assert str(path) in str(info.value)
    assert "line 3" in info.value.fix


def test_yaml_parse_error_names_line(tmp_path: Path) -> None:
    """A YAML syntax error reports the file and the line it is on."""
    path = write(tmp_path / "kvcr.yaml", "pool_bytes: 1GiB\nmax_leases: [1, 2\nlog_level: INFO\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.field == "config_file"
    assert "line 3" in info.value.fix


@pytest.mark.parametrize("text", ["- pool_bytes\n", "just a string\n", "kvcr: [1, 2]\n"])
def test_top_level_must_be_mapping(tmp_path: Path, text: str) -> None:
    """A list or scalar at the top (or under 'kvcr') is refused with the expected shape."""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path / "kvcr.yaml", text), env={})
    assert info.value.field == "config_file"
    assert "mapping" in info.value.fix


def test_precedence_file_env_overrides(tmp_path: Path) -> None:
    """Layers apply defaults < file < env < overrides, field by field."""
    path = write(tmp_path / "kvcr.yaml", "pool_bytes: 1GiB\nmax_leases: 10\nlog_level: ERROR\n")
    env = {"KVCR_POOL_BYTES": "2GiB", "KVCR_MAX_LEASES": "20"}
    assert load_config(path, env={}).pool_bytes == GiB
    from_env = load_config(path, env=env)
    assert (from_env.pool_bytes, from_env.max_leases, from_env.log_level) == (2 * GiB, 20, "ERROR")
    cfg = load_config(path, env=env, overrides={"pool_bytes": "3GiB"})
    assert (cfg.pool_bytes, cfg.max_leases, cfg.log_level) == (3 * GiB, 20, "ERROR")
    assert cfg.max_reservations == 4096


def test_env_without_file() -> None:
    """Environment variables alone configure every kind of field."""
    cfg = load_config(
        env={
            "KVCR_EVICTION_POLICY": "arc",
            "KVCR_MEMORY_BACKING": "anonymous",
            "KVCR_NAMESPACE_POOL_BYTES": "512MiB",
            "PATH": "/usr/bin",
            "kvcr_pool_bytes": "ignored: not upper-case KVCR_",
        }
    )
    assert cfg.eviction_policy == "arc"
    assert cfg.memory_backing is MemoryBacking.ANONYMOUS
    assert cfg.namespace_pool_bytes == 512 * MiB


def test_unknown_env_var_is_ignored_with_a_warning_naming_the_likely_one(
        caplog: pytest.LogCaptureFixture) -> None:
    """Risk: kvcr refuses to start in a Kubernetes namespace with Services named kvcr,
    kvcr-guard or kvcr-router (the kubelet injects KVCR_GUARD_PORT, KVCR_SERVICE_HOST...),
    or a misspelt variable is silently ignored: it is ignored, and said once, with a
    did-you-mean."""
    injected = {"KVCR_GUARD_PORT": "tcp://10.0.0.5:9750", "KVCR_GUARD_SERVICE_HOST": "10.0.0.5",
                "KVCR_ROUTER_PORT_8000_TCP": "tcp://10.0.0.6:8000", "KVCR_SERVICE_PORT": "80"}
    with caplog.at_level("WARNING", logger="kvcr_core.config"):
        assert load_config(env={**injected, "KVCR_POOL_BYTE": "8GiB",
                                "KVCR_LOG_LEVEL": "debug"}) == KVCRConfig(log_level="DEBUG")
    assert "did you mean 'KVCR_POOL_BYTES'" in caplog.text and "KVCR_GUARD_PORT" in caplog.text


def test_env_var_name_must_be_upper_case() -> None:
    """KVCR_Pool_Bytes never races KVCR_POOL_BYTES for the same field: it sets nothing."""
    assert load_config(env={"KVCR_Pool_Bytes": "8GiB"}) == KVCRConfig()


def test_foreign_env_vars_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Variables owned by other kvcr tools (FOREIGN_ENV_VARS) are not config errors."""
    monkeypatch.setattr(config_module, "FOREIGN_ENV_VARS", frozenset({"KVCR_GUARD_SOCKET"}))
    assert load_config(env={"KVCR_GUARD_SOCKET": "/run/kvcr.sock"}) == KVCRConfig()


def test_bad_env_value_names_variable() -> None:
    """A bad environment value names the field, the value and the variable that set it."""
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVCR_MAX_HINT_ACTIONS": "100"})
    assert info.value.field == "max_hint_actions"
    assert info.value.value == "100"
    assert "KVCR_MAX_HINT_ACTIONS" in info.value.fix


def test_unknown_override_refused() -> None:
    """Overrides are checked like any other layer."""
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"log_levl": "DEBUG"})
    assert info.value.field == "log_levl"
    assert "did you mean 'log_level'" in info.value.fix


def test_env_none_reads_process_environment() -> None:
    """env=None resolves exactly as an explicit copy of os.environ (read, never written)."""
    try:
        expected: KVCRConfig | str = load_config(env=dict(os.environ))
    except ConfigError as err:
        expected = str(err)
    try:
        actual: KVCRConfig | str = load_config()
    except ConfigError as err:
        actual = str(err)
    assert actual == expected


def test_example_file_loads_and_covers_every_field() -> None:
    """examples/kvcr.yaml is accepted by load_config and shows every field."""
    path = REPO_ROOT / "examples" / "kvcr.yaml"
    cfg = load_config(path, env={})
    assert isinstance(cfg, KVCRConfig)
    text = path.read_text(encoding="utf-8")
    assert all(f"\n{name}:" in text or f"\n  {name}:" in text for name in FIELD_NAMES)


def test_docs_cover_every_field() -> None:
    """docs/config.md lists every field and its environment variable."""
    text = (REPO_ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    for name in FIELD_NAMES:
        assert f"`{name}`" in text
        assert f"`{env_var_name(name)}`" in text
