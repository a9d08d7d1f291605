"""Alert rules and dashboard (deploy/monitoring), offline: promtool checks the rules and runs
their unit tests, every alert is covered (fires and stays quiet), and the generated files
(dashboard JSON, PrometheusRule) are what generate.py writes now. Their PromQL against real
kvcr processes: test_prometheus_live.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
RULES = MONITORING / "kvcr-rules.yaml"
RULE_TESTS = MONITORING / "kvcr-rules.test.yaml"


def alerts() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules_and_passes_their_unit_tests(tools) -> None:
    """Risk: a rule Prometheus refuses to load, or an alert that does not fire (or fires)
    on the series its unit test describes."""
    promtool = tools.system("promtool")
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        out = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120,
                             check=False, cwd=MONITORING)
        assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    """Risk: an alert nobody tested (promtool passes a file that never mentions it)."""
    fired, quiet = set(), set()
    for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in group["alert_rule_test"]:
            (fired if case["exp_alerts"] else quiet).add(case["alertname"])
    names = alerts()
    assert len(names) == len(set(names)) >= 7
    assert fired == set(names) and quiet == set(names)
    for name in ("KvcrGuardDown", "KvcrFailuresRising", "KvcrPeerChecksumMismatch",
                 "KvcrPeerAuthRefused", "KvcrPoolThrashing", "KvcrRouterNoHealthyWorker"):
        assert name in names


def test_generated_dashboard_and_prometheus_rule_are_up_to_date(tools, manifests) -> None:
    """Risk: someone edits the rules or the panels and ships a stale dashboard JSON or
    PrometheusRule (the Kubernetes rules would differ from the tested ones)."""
    out = subprocess.run([tools.venv("python"), str(MONITORING / "generate.py"), "--check"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    (rule,) = manifests.find("monitoring", "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    board = json.loads((MONITORING / "kvcr-dashboard.json").read_text())
    assert board["uid"] == "kvcr-overview"
    titles = [p["title"] for p in board["panels"] if p["type"] != "row"]
    assert len(titles) == len(set(titles)) >= 20
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
