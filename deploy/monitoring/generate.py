"""Writes kvcr's Grafana dashboard (kvcr-dashboard.json, from the panels below, with
grafana-foundation-sdk) and the PrometheusRule that ships kvcr-rules.yaml to the Prometheus
Operator (deploy/kubernetes/monitoring/prometheusrule.yaml).

    python deploy/monitoring/generate.py           # write both files
    python deploy/monitoring/generate.py --check   # exit 1 if either is out of date

Runs in the deploy tools' environment (scripts/setup_deploy.sh: .venv-deploy). Every query
names series kvcr exports today; tests/deploy/test_prometheus_live.py evaluates each one
against a real Prometheus scraping real kvcr processes, so a misspelt metric fails CI.
Jobs: kvcr-guard (kvcr-guard's /metrics), kvcr-engine (vLLM's), kvcr-router.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

HERE = Path(__file__).resolve().parent
DASHBOARD_JSON = HERE / "kvcr-dashboard.json"
RULES = HERE / "kvcr-rules.yaml"
PROMETHEUS_RULE = HERE.parent / "kubernetes" / "monitoring" / "prometheusrule.yaml"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
W = "5m"  # the rate window of every panel


def rate(metric: str, by: str = "instance") -> str:
    return f"sum by ({by}) (rate({metric}[{W}]))"


def quantile(q: float, bucket: str, by: str = "le") -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({bucket}[{W}])))"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: list[tuple[str, str]]  # (PromQL, legend)
    kind: str = "timeseries"  # or "stat"
    width: int = 8


@dataclass(frozen=True)
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


ROWS = [
    Row("Cache: what kvcr saves", [
        Panel("Prompt tokens served from kvcr",
              "Share of all prompt tokens whose KV vLLM loaded from kvcr instead of computing.",
              "percentunit",
              [(f"sum(rate(vllm:kvcr_loaded_tokens_total[{W}])) / "
                f"sum(rate(vllm:prompt_tokens_total[{W}]))", "from kvcr")], kind="stat"),
        Panel("Tokens served from kvcr",
              "Prompt tokens per second loaded from kvcr, and the external prefix-cache hits "
              "vLLM counts for them.", "short",
              [(rate("vllm:kvcr_loaded_tokens_total"), "{{instance}} loaded"),
               (rate("vllm:external_prefix_cache_hits_total"), "{{instance}} external hits")]),
        Panel("Pool hit ratio",
              "Blocks found READY over blocks looked up, per kvcr-guard.", "percentunit",
              [(f"{rate('kvcr_lookup_hit_blocks_total')} / ({rate('kvcr_lookup_hit_blocks_total')}"
                f" + {rate('kvcr_lookup_miss_blocks_total')})", "{{instance}}")]),
        Panel("Time to first token",
              "vLLM's TTFT quantiles over every engine.", "s",
              [(quantile(q, "vllm:time_to_first_token_seconds_bucket"), f"p{int(q * 100)}")
               for q in (0.5, 0.9, 0.99)], width=12),
        Panel("Load time",
              "Time to load one request's KV from kvcr (vLLM connector).", "s",
              [(quantile(q, "vllm:kvcr_load_seconds_bucket"), f"p{int(q * 100)}")
               for q in (0.5, 0.99)], width=12),
    ]),
    Row("Loads and saves", [
        Panel("Pool load / save bytes",
              "Bytes leased for reading and committed, per kvcr-guard.", "Bps",
              [(rate("kvcr_loaded_bytes_total"), "{{instance}} load"),
               (rate("kvcr_stored_bytes_total"), "{{instance}} save")]),
        Panel("Engine blocks loaded / saved",
              "Blocks each vLLM engine loaded from and saved into kvcr.", "short",
              [(rate("vllm:kvcr_loaded_blocks_total"), "{{instance}} loaded"),
               (rate("vllm:kvcr_stored_blocks_total"), "{{instance}} saved")]),
        Panel("Failures by reason",
              "kvcr faults, each degraded to recompute (docs/vllm.md).", "short",
              [(rate("vllm:kvcr_failures_total", "reason"), "{{reason}}")]),
        Panel("Requests kvcr does not cache",
              "Requests whose KV depends on more than token ids, by reason.", "short",
              [(rate("vllm:kvcr_bypassed_requests_total", "reason"), "{{reason}}")]),
        Panel("KV hints by outcome",
              "Hints the engines and the runners received, accepted or refused.", "short",
              [(rate("vllm:kvcr_hints_total", "outcome"), "engine {{outcome}}"),
               (rate("kvcr_hints_total", "outcome"), "runner {{outcome}}")]),
    ]),
    Row("Pool", [
        Panel("Pool occupancy",
              "Slot bytes FILLING or READY over the pool's capacity, per runner and "
              "namespace (its digest's first 16 hex digits: `kvcr status` names it).",
              "percentunit",
              [("sum by (instance, namespace) (kvcr_pool_used_bytes) / "
                "sum by (instance, namespace) (kvcr_pool_capacity_bytes)",
                "{{instance}} {{namespace}}")]),
        Panel("Evictions and refusals",
              "READY blocks evicted to make room (per namespace), reservations abandoned, "
              "and requests refused at a capacity bound (by resource).", "short",
              [(rate("kvcr_evictions_total", "instance, namespace"),
                "{{instance}} {{namespace}} evicted"),
               (rate("kvcr_blocks_aborted_total"), "{{instance}} aborted"),
               (rate("kvcr_capacity_refusals_total", "resource"), "refused {{resource}}")]),
        Panel("Pool bytes",
              "Used and total pool bytes, per kvcr-guard.", "bytes",
              [("sum by (instance) (kvcr_pool_used_bytes)", "{{instance}} used"),
               ("sum by (instance) (kvcr_pool_capacity_bytes)", "{{instance}} capacity")]),
    ]),
    Row("Peers", [
        Panel("Peer fetches by status",
              "Blocks asked of peers: ok, present, missing, checksum, timeout...", "short",
              [(rate("kvcr_peer_fetched_blocks_total", "status"), "{{status}}")]),
        Panel("Peer bytes",
              "Verified bytes received from peers and bytes served to them.", "Bps",
              [(rate("kvcr_peer_fetched_bytes_total"), "{{instance}} fetched"),
               (rate("kvcr_peer_served_bytes_total"), "{{instance}} served")]),
        Panel("Peer connections and refusals",
              "Peer connections by transport, and refusals by reason (auth: a wrong secret).",
              "short",
              [(rate("kvcr_peer_connections_total", "transport"), "{{transport}}"),
               (rate("kvcr_peer_refusals_total", "reason"), "refused {{reason}}")]),
    ]),
    Row("Guard", [
        Panel("Attached clients",
              "Engine processes attached to each kvcr-guard, and connections not attached "
              "yet.", "short",
              [("sum by (instance) (kvcr_guard_clients)", "{{instance}} attached"),
               ("sum by (instance) (kvcr_guard_pending_connections)", "{{instance}} pending")]),
        Panel("Reclaims",
              "FILLING blocks aborted and leases released for engines that went away.",
              "short",
              [(rate("kvcr_guard_reclaimed_blocks_total"), "{{instance}} blocks"),
               (rate("kvcr_guard_reclaimed_leases_total"), "{{instance}} leases")]),
        Panel("Connections closed by reason",
              "eof is normal (probes, engine restarts); client_died, malformed, quota... "
              "are not.", "short",
              [(rate("kvcr_guard_connections_closed_total", "reason"), "{{reason}}")]),
        Panel("Guard request time",
              "Time to serve one request frame (p99), per kvcr-guard.", "s",
              [(quantile(0.99, "kvcr_guard_request_seconds_bucket", "le, instance"),
                "{{instance}} p99")]),
    ]),
    Row("Router", [
        Panel("Decisions by worker", "Requests routed to each worker.", "reqps",
              [(rate("kvcr_router_decisions_total", "worker"), "{{worker}}")]),
        Panel("Hints by outcome",
              "Per decision: a hint sent, or why not.", "short",
              [(rate("kvcr_router_hints_total", "outcome"), "{{outcome}}")]),
        Panel("Worker health", "1 if the worker's last health check passed.", "short",
              [("max by (worker) (kvcr_router_worker_healthy)", "{{worker}}")]),
        Panel("Requests by outcome", "Router answers by outcome.", "reqps",
              [(rate("kvcr_router_requests_total", "outcome"), "{{outcome}}")]),
        Panel("Decision time", "Tokenize, hash and choose, per request.", "s",
              [(quantile(q, "kvcr_router_decision_seconds_bucket"), f"p{int(q * 100)}")
               for q in (0.5, 0.99)]),
        Panel("Prompts routed on load alone",
              "Requests whose prompt was not hashed, by reason (docs/router.md).", "short",
              [(rate("kvcr_router_unhashed_total", "reason"), "{{reason}}")]),
        Panel("Client hints stripped",
              "Client-supplied hints and transfer params the router removed.", "short",
              [(rate("kvcr_router_client_hints_stripped_total", "field"), "{{field}}")]),
        Panel("Inventory polls",
              "Polls of each worker's pool inventory, by outcome.", "short",
              [(rate('kvcr_router_feed_polls_total{feed="inventory"}', "worker, outcome"),
                "{{worker}} {{outcome}}")]),
        Panel("Worker load", "Requests this router has in flight at each worker.", "short",
              [("max by (worker) (kvcr_router_worker_active_requests)", "{{worker}}")]),
    ]),
]


def _panel(panel: Panel) -> timeseries.Panel | stat.Panel:
    builder = stat.Panel() if panel.kind == "stat" else timeseries.Panel()
    builder = (builder.title(panel.title).description(panel.description).unit(panel.unit)
               .datasource(DATASOURCE).height(8).span(panel.width))
    for ref, (expr, legend) in zip("ABCDEFGH", panel.queries, strict=False):
        builder = builder.with_target(
            prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref))
    return builder


def build_dashboard() -> dict:
    board = (dashboard.Dashboard("kvcr").uid("kvcr-overview").tags(["kvcr"])
             .description("kvcr: KV cache reuse, loads and saves, pool, peers, kvcr-guard "
                          "and kvcr-router (docs/monitoring.md)")
             .refresh("30s").time("now-3h", "now").timezone("browser")
             .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus")
                            .type("prometheus")))
    for row in ROWS:
        board = board.with_row(dashboard.Row(row.title))
        for panel in row.panels:
            board = board.with_panel(_panel(panel))
    data: dict = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return data


def prometheus_rule() -> dict:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "kvcr", "labels": {"app.kubernetes.io/part-of": "kvcr"}},
            "spec": {"groups": groups}}


def rendered() -> dict[Path, str]:
    header = ("# Written by deploy/monitoring/generate.py from deploy/monitoring/kvcr-rules.yaml"
              ": edit that file, then run the script.\n")
    return {DASHBOARD_JSON: json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n",
            PROMETHEUS_RULE: header + yaml.safe_dump(prometheus_rule(), sort_keys=False,
                                                     width=100)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    args = ap.parse_args()
    stale = []
    for path, text in rendered().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print("out of date (run deploy/monitoring/generate.py): "
              + ", ".join(str(p) for p in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
