"""`missing_setup`: a test whose set-up is absent fails in CI and is skipped elsewhere, naming
the script (risk: CI silently skips a whole layer because a venv was not made). Unit layer."""

from __future__ import annotations

import pytest

from kvcr_core.testing.setup import missing_setup

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("ci", "outcome"), [("true", pytest.fail.Exception),
                                             (None, pytest.skip.Exception)])
def test_missing_setup_fails_in_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch,
                                                       ci: str | None, outcome: type) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match=r"run bash scripts/setup_docs\.sh"):
        missing_setup(".venv-docs is missing: run bash scripts/setup_docs.sh")
