"""`kvcr config check FILE`: load a config as the Runner would and print the resolved values,
or the error that names the field and the fix."""

from __future__ import annotations

import json
import os
import sys

from kvcr_core.config import load_config
from kvcr_core.errors import ConfigError
from kvcr_core.eviction import resolve_policy


def run_config_check(path: str, *, use_env: bool) -> int:
    try:
        config = load_config(path, env=None if use_env else {})
        resolve_policy(config.eviction_policy)
    except ConfigError as exc:
        print(f"kvcr config check: {path}: {exc}", file=sys.stderr)
        return 1
    env_note = " (with KVCR_* environment overrides)" if use_env and any(
        k.startswith("KVCR_") for k in os.environ) else ""
    print(f"{path}: OK{env_note}")
    print(json.dumps(config.to_dict(), indent=2, sort_keys=True))
    return 0
