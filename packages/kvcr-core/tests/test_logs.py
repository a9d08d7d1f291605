"""Log hygiene: client-chosen strings cannot forge log lines, and a burst of refusals cannot
flood the log (each is still counted elsewhere)."""

from __future__ import annotations

import logging

import pytest

from kvcr_core.logs import ThrottledLog, printable
from kvcr_core.testing import ManualClock

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text, shown", [
    ("engine-0", "engine-0"),
    ("evil\n2026-12-01 ERROR kvcr forged", "evil\\x0a2026-12-01 ERROR kvcr forged"),
    ("\r\x1b[31mred\x00", "\\x0d\\x1b[31mred\\x00"),
    ("caf\u00e9 \u202etxt", "caf\\xe9 \\u202etxt"),
])
def test_printable_escapes_every_control_and_non_ascii_character(text: str, shown: str) -> None:
    """Risk: an identity or hint id with a newline or terminal escape writes a fake log line
    (or recolours the operator's terminal)."""
    assert printable(text) == shown
    assert all(" " <= c <= "~" for c in printable(text))


def test_printable_cuts_long_values() -> None:
    """Risk: one client-chosen megabyte string per log line fills the disk."""
    assert printable("x" * 1000, 10) == "x" * 10 + "..."


def test_throttled_log_holds_back_repeats_and_says_how_many(
        caplog: pytest.LogCaptureFixture) -> None:
    """Risk: 10,000 hostile connections write 10,000 warnings; or the throttle hides that
    anything happened."""
    clock = ManualClock()
    throttled = ThrottledLog(logging.getLogger("kvcr_test_logs"), 10.0, clock=clock)
    with caplog.at_level(logging.WARNING, "kvcr_test_logs"):
        for _ in range(1000):
            throttled.log(logging.WARNING, "refused", "refused %s", "a")
        throttled.log(logging.WARNING, "other", "other reason")
        clock.advance(11)
        throttled.log(logging.WARNING, "refused", "refused %s", "b")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused a", "other reason", "refused b (999 more like it held back)"]


def test_throttled_log_keys_stay_bounded() -> None:
    """Risk: a key per client-chosen value grows the throttle's table without bound."""
    throttled = ThrottledLog(logging.getLogger("kvcr_test_logs"), 10.0, clock=ManualClock(),
                             max_keys=8)
    for i in range(1000):
        throttled.log(logging.DEBUG, f"k{i}", "m")
    assert len(throttled._last) <= 8
