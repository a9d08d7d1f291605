"""Connector statistics, shipped the way vLLM wants them (`KVConnectorStats`, serialisable,
aggregated across workers and the scheduler) and exported into vLLM's own `/metrics` as
`vllm:kvcr_*` (`KVCRPromMetrics`). Labels are bounded: failure reasons, hint outcomes and
bypass reasons from fixed sets.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvcr_core.hints import HINT_OUTCOMES

COUNTERS = ("loaded_blocks", "loaded_tokens", "stored_blocks", "stored_tokens",
            "lookup_hit_tokens", "lookups", "peer_fetched_blocks", "pull_lookups",
            "pulled_blocks", "pulled_bytes", "hint_unmatched_blocks",
            "fetch_wait_expired")
FAILURE_REASONS = ("guard_unavailable", "load_copy", "save_copy", "evicted_before_load",
                   "save_refused", "config", "peer_not_allowed", "peer_fetch", "load_checksum",
                   "pin_failed", "cuda_call")
BYPASS_REASONS = ("multimodal", "prompt_embeds", "lora")
_LOAD_SAMPLES_MAX = 512
_LOAD_BUCKETS_S = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


def _empty() -> dict[str, Any]:
    return {"counters": dict.fromkeys(COUNTERS, 0), "failures": {}, "hints": {},
            "bypassed": {}, "load_seconds": []}


@dataclasses.dataclass
class KVCRConnectorStats(KVConnectorStats):
    data: dict[str, Any] = dataclasses.field(default_factory=_empty)

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVCRConnectorStats:
        d, o = self.data, other.data
        for name, value in o.get("counters", {}).items():
            d["counters"][name] = d["counters"].get(name, 0) + value
        for table in ("failures", "hints", "bypassed"):
            for name, value in o.get(table, {}).items():
                d[table][name] = d[table].get(name, 0) + value
        d["load_seconds"] = (d["load_seconds"] + o.get("load_seconds", []))[-_LOAD_SAMPLES_MAX:]
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counters"])
        for table in ("failures", "hints", "bypassed"):
            for name, value in self.data[table].items():
                out[f"{table}_{name}"] = value
        samples = self.data["load_seconds"]
        if samples:
            out["load_ms_avg"] = round(1000 * sum(samples) / len(samples), 3)
        return out

    def is_empty(self) -> bool:
        d = self.data
        return not (any(d["counters"].values()) or d["failures"] or d["hints"]
                    or d["bypassed"] or d["load_seconds"])


class StatsRecorder:
    """Thread-safe accumulation between two `take()` calls (the worker's copy thread and
    the engine thread both record)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVCRConnectorStats()

    def add(self, counter: str, value: int = 1) -> None:
        with self._lock:
            self._stats.data["counters"][counter] += value

    def count(self, table: str, name: str, value: int = 1) -> None:
        with self._lock:
            bucket = self._stats.data[table]
            bucket[name] = bucket.get(name, 0) + value

    def failure(self, reason: str, value: int = 1) -> None:
        assert reason in FAILURE_REASONS, reason
        self.count("failures", reason, value)

    def hint_outcome(self, outcome: str) -> None:
        self.count("hints", outcome)

    def load_seconds(self, seconds: float) -> None:
        with self._lock:
            samples = self._stats.data["load_seconds"]
            if len(samples) < _LOAD_SAMPLES_MAX:
                samples.append(seconds)

    def take(self) -> KVCRConnectorStats | None:
        with self._lock:
            stats, self._stats = self._stats, KVCRConnectorStats()
        return None if stats.is_empty() else stats


class KVCRPromMetrics(KVConnectorPromMetrics):
    """`vllm:kvcr_*` in vLLM's registry, one child per engine and label value."""

    def __init__(self, vllm_config: VllmConfig,
                 metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        docs = {"loaded_blocks": "Blocks loaded from kvcr into the engine",
                "loaded_tokens": "Prompt tokens whose KV was loaded from kvcr",
                "stored_blocks": "Blocks saved from the engine into kvcr",
                "stored_tokens": "Tokens whose KV was saved into kvcr",
                "lookup_hit_tokens": "Tokens kvcr offered beyond the engine's own prefix cache",
                "lookups": "kvcr lookups made by the scheduler",
                "peer_fetched_blocks": "Blocks fetched from a hinted peer (verified)",
                "pull_lookups": "Lookups that found a run a peer holds (pull on miss)",
                "pulled_blocks": "Blocks pulled from peers on a local miss (verified)",
                "pulled_bytes": "Bytes of those blocks, every TP rank's shard",
                "hint_unmatched_blocks": "Hinted block hashes that named no block of the "
                "request (hint_hash_scheme mismatch or another prompt): not fetched",
                "fetch_wait_expired": "Peer fetches still running when the scheduler's "
                "fetch_wait_s ended (the request waits in later steps)"}
        # vLLM types its metric classes as a union of Counter, Gauge and Histogram
        self._counters: dict[str, Any] = {name: self._counter_cls(
            name=f"vllm:kvcr_{name}_total", documentation=doc, labelnames=labelnames)
            for name, doc in docs.items()}
        self._tables: dict[str, tuple[Any, tuple[str, ...]]] = {
            "failures": (self._counter_cls(
                name="vllm:kvcr_failures_total",
                documentation="kvcr faults (each degraded to recompute), by reason",
                labelnames=[*labelnames, "reason"]), FAILURE_REASONS),
            "hints": (self._counter_cls(
                name="vllm:kvcr_hints_total", documentation="KV hints received, by outcome",
                labelnames=[*labelnames, "outcome"]), HINT_OUTCOMES),
            "bypassed": (self._counter_cls(
                name="vllm:kvcr_bypassed_requests_total",
                documentation="Requests kvcr does not cache, by reason (keys need more than "
                "token ids)", labelnames=[*labelnames, "reason"]), BYPASS_REASONS),
        }
        histogram: Any = self._histogram_cls
        self._load_seconds = histogram(
            name="vllm:kvcr_load_seconds", documentation="Time to load one request's KV",
            buckets=list(_LOAD_BUCKETS_S), labelnames=labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.get("counters", {}).items():
            if name in self._counters and value:
                self._counters[name].labels(*labels).inc(value)
        for table, (metric, allowed) in self._tables.items():
            for key, value in transfer_stats_data.get(table, {}).items():
                if key in allowed:
                    metric.labels(*labels, key).inc(value)
        for seconds in transfer_stats_data.get("load_seconds", []):
            self._load_seconds.labels(*labels).observe(seconds)
