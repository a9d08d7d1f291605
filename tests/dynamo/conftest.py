"""Fixtures of the Dynamo checks: `dynamo_venv` stops a test whose side venv is missing
(scripts/setup_dynamo.sh makes it): a failure in CI (CI=true), a skip elsewhere."""

from __future__ import annotations

import pytest

from kvcr_bench import dynamo_rig
from kvcr_core.testing.setup import missing_setup


@pytest.fixture(scope="session")
def dynamo_venv() -> None:
    reason = dynamo_rig.missing()
    if reason is not None:
        missing_setup(reason)
