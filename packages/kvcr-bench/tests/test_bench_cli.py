"""`kvcr bench ...` as an operator runs it: the installed console script of kvcr-core finds the
benchmarks kvcr-bench installs, and they run end to end (quick variants)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcr_core.testing.uids import other_uid_unavailable

pytestmark = pytest.mark.integration

KVCR = str(Path(sys.executable).parent / "kvcr")


def kvcr(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCR_")}
    return subprocess.run([KVCR, *args], capture_output=True, text=True, env=env, timeout=600,
                          check=False)


@pytest.mark.slow
def test_bench_pool_quick_json_reports_the_summary() -> None:
    """`kvcr bench pool --quick --json` runs end to end and reports every summary figure."""
    out = kvcr("bench", "pool", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    summary = result["summary"]
    for name in ("min_ratio_vs_memcpy_256k", "lookup_1000_keys_us", "index_ops_per_s",
                 "index_bytes_per_block"):
        assert summary[name] > 0
    assert {r["block_bytes"] for r in result["rows"]} == {65536, 262144, 2097152}


@pytest.mark.slow
def test_bench_tier_quick_json_reports_both_modes() -> None:
    """`kvcr bench tier --quick --json` drives vLLM's real tiering manager with kvcr's tier,
    embedded and through kvcr-guard: every chunk stored, promoted and found (the bench
    checks), every rate and target verdict reported."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    out = kvcr("bench", "tier", "--quick", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert set(result["rows"]) == {"embedded", "guarded"}
    for row in result["rows"].values():
        for name in ("memcpy_gbps", "store_gbps", "promote_gbps", "lookup_us_per_block"):
            assert row[name] > 0
    assert all(isinstance(v, bool) for v in result["meets_targets"].values())
    assert set(result["meets_targets"]) == {"lookup_us_per_block", "store_ratio_vs_memcpy",
                                            "promote_ratio_vs_memcpy"}


@pytest.mark.slow
def test_bench_peer_quick_json_reports_both_transports() -> None:
    """`kvcr bench peer --quick --json` runs end to end: every TCP row and summary figure, and
    the NIXL ones exactly when nixl is installed (null otherwise)."""
    from kvcr_core.peers.nixl_engine import nixl_installed

    out = kvcr("bench", "peer", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    summary, nixl = result["summary"], nixl_installed()
    for name in ("tcp_ratio_vs_raw_256k", "tcp_ratio_vs_raw_256k_cold", "small_fetch_p50_us",
                 "tcp_fleet_ratio_vs_raw_256k", "fleet_vs_secret_256k"):
        assert summary[name] > 0  # (fleet: the same TCP fetches with origin tags)
    for name in ("nixl_ratio_vs_raw_256k", "nixl_ratio_vs_raw_256k_cold",
                 "nixl_small_fetch_p50_us"):
        assert (summary[name] > 0) if nixl else summary[name] is None
    loopback = {(r["transport"], r["block_bytes"]) for r in result["rows"]
                if r["path"] == "loopback"}
    sizes = {65536, 262144, 2097152}
    assert loopback == {(t, b) for t in (("tcp", "nixl") if nixl else ("tcp",)) for b in sizes} \
        | {("tcp+fleet", 262144), ("tcp+fleet", 2097152)}
    assert all(r["raw_checked_ratio"] > 0 for r in result["rows"])  # the verified reference




@pytest.fixture(scope="module")
def under_attack() -> dict[str, Any]:
    """One `kvcr bench guard --under-attack --quick --json` run, its rows by case."""
    out = kvcr("bench", "guard", "--under-attack", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    result["by_case"] = {r["case"]: r for r in result["rows"]}
    return result


@pytest.mark.slow
def test_bench_guard_under_attack_runs_every_attack_and_checks_the_engines_blocks(
        under_attack: dict[str, Any]) -> None:
    """`kvcr bench guard --under-attack --quick --json` runs every attacker mode against a
    real daemon, which survives all of them; only the scribbler (same uid) and the hole
    puncher (a uid sharing the engine's tenant) can touch the engine's blocks, and never
    unnoticed (a changed block fails its checksum)."""
    from kvcr_bench.guard_attack import CASES

    rows = under_attack["by_case"]
    assert list(rows) == list(CASES)
    ran = {c: r for c, r in rows.items() if not r.get("skipped")}
    assert all(r["round_trips"] > 100 and r["p99_ms"] > 0 for r in ran.values())
    skipped = {c for c in rows if c not in ran}
    assert skipped == (set() if other_uid_unavailable() is None else {"foreign-flood"})
    assert all(r["engine_blocks_intact"] for c, r in ran.items()
               if c not in ("scribble", "punch"))
    assert under_attack["summary"]["worst_p99_ms"] == max(r["p99_ms"] for r in ran.values())


@pytest.mark.slow
def test_bench_guard_under_attack_reports_what_each_trust_attack_got(
        under_attack: dict[str, Any]) -> None:
    """The trust cases (issue 36) attack as uid 65534 where the bench may switch uids, and
    the bench reports their outcome: the engine refuses a fake server before sending a byte,
    still stores everything it asks for while another uid opens junk namespaces or a uid not
    allowed floods the socket (the kernel turns it away), punched blocks are dropped
    (kvcr_holed_blocks_total) or fail the engine's check, and a poisoning fleet node's
    blocks are all refused; no attack makes the engine use zeros or hold poisoned bytes."""
    rows = under_attack["by_case"]
    other = other_uid_unavailable() is None
    for case in ("capture", "foreign-flood", "fake-server", "punch"):
        assert rows[case]["attacker"] == ("uid 65534" if other else
                                          "-" if case == "foreign-flood" else "same uid*")
    if other:
        assert rows["fake-server"]["refused"] == "untrusted_runner"
        assert rows["fake-server"]["attack"] == {"connections": 1, "received_bytes": 0}
        assert rows["capture"]["attack"]["opened"] >= 1
        assert rows["capture"]["attack"]["refused"] >= 1  # it asked for more than its share
        assert rows["foreign-flood"]["attack"]["connections"] == 0  # refused by the kernel
        for case in ("capture", "foreign-flood"):
            assert rows[case]["engine_stored_blocks"] == rows[case]["engine_asked_blocks"] > 0
            assert rows[case]["engine_failed_steps"] == 0
        assert rows["punch"]["engine_zero_blocks"] == 0  # a shared tenant: loads verified
    assert rows["punch"]["attack"]["punches"] > 0 and rows["punch"]["holed_blocks"] > 0
    assert all(r["engine_zero_blocks"] == 0 for c, r in rows.items() if c != "punch")
    poison = rows["poison"]
    assert poison["peer_refused_blocks"] > 0 and poison["peer_accepted_blocks"] == 0
    assert under_attack["summary"]["poisoned_blocks_loaded"] == 0


@pytest.mark.slow
def test_bench_pull_quick_json_reports_every_case() -> None:
    """`kvcr bench pull --quick --json` runs two real vLLM engines end to end: the pulled and
    the hinted prompts were really reused (hit tokens), and every figure is reported."""
    out = kvcr("bench", "pull", "--quick", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)["summary"]
    assert summary["pull_hit_tokens_min"] >= 2048 - 32
    assert summary["hint_hit_tokens_min"] >= 2048 - 32
    for name in ("ttft_pull_ms", "ttft_hint_ms", "ttft_local_prefix_ms"):
        assert summary[name]["p50_ms"] > 0
    assert all(row["pulled"] for row in summary["break_even"])
    assert summary["commit_to_known_ms"]["p99_ms"] > 0
    assert 0 < summary["follower_bytes_per_block"] < 400
