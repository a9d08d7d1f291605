"""`missing_setup(message)`: what a test does when something a set-up script installs is
absent (a side venv, a tool): it fails in CI (`CI` set: the README's test command installs
everything, so absence there is a bug) and is skipped elsewhere, naming the script to run."""

from __future__ import annotations

import os
from typing import NoReturn


def missing_setup(message: str) -> NoReturn:
    import pytest  # only tests call this

    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
