"""`KVCRPoolTier`: kvcr's pool as a secondary tier of vLLM's own OffloadingConnector.

vLLM's tiering framework (`vllm/v1/kv_offload/tiering`) keeps a CPU primary tier that vLLM
fills from the GPU with its own copies; secondary tiers see only that host memory. This tier
cascades every chunk the primary tier stores into kvcr slots (embedded Runner, or kvcr-guard
shared by the node's engines and surviving their crashes) and promotes chunks kvcr holds back
into the primary tier, so a GPU user keeps vLLM's native offload path and adds kvcr:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8589934592, "secondary_tiers": [
        {"type": "KVCRPoolTier", "module_path": "kvcr_vllm.offload_tier",
         "mode": "guarded", "socket": "/run/kvcr/guard.sock"}]}}'

The tier's keys are the connector's engine keys (`mode`, `socket`, `pool_bytes`, ...,
kvcr_core.attach.settings), validated the same way; unknown keys are errors.

- Keys: a chunk is named by vLLM's offload key (its block hash and KV cache group); its kvcr
  key is that key hashed under the namespace (engine, model, dtype, chunk size, parallel
  layout), so engines that hash prompts alike (vLLM's default sha256 block hashes) share.
- Slots: one kvcr slot per primary chunk (the primary view's row), copied whole.
- Jobs: `submit_store` / `submit_load` only queue (the framework's rule: every method runs in
  vLLM's scheduler process and must not block); one thread runs them: a store reserves,
  copies the primary rows into the granted slots, hashes and commits them, a batch of chunks
  at a time (chunks kvcr holds already count as stored); a load leases, copies slots into
  the primary rows and releases. Results come back through `get_finished_jobs`. The queue
  is bounded: a job that does not fit fails at once (a store is then a future miss, a
  promotion a recompute).
- Lookups: a chunk this tier stored, promoted or found before is a HIT without asking the
  Runner (a bounded set, forgotten as the Runner's inventory log reports removals, read at
  most every `FORGET_EVERY_S` at the end of a scheduler step; a removal not yet read fails
  the promotion, and the request recomputes); any other chunk costs one lookup round trip.
- Faults: a Runner that cannot be reached, refuses or fails a copy makes lookups misses and
  jobs failures, counted; nothing raises into the scheduler.
- KV events (with vLLM's KV events on): a chunk this tier stored is announced stored (medium
  CPU, owned by this tier), and announced removed once the Runner's removal log reports it
  gone (all of them when the log cannot say: kvcr restarted, or this reader fell behind), so
  a router credits what kvcr holds, never more. Chunks other engines stored are theirs to
  announce. Bounded like the set of known chunks.
- Metrics, in vLLM's /metrics through the framework (`build_metric_definitions`,
  `get_stats`): `vllm:kvcr_tier_chunks{event}` (stored, promoted, store_refused),
  `vllm:kvcr_tier_failures{reason}` (runner_unavailable, queue_full, store_failed,
  promotion_failed) and the gauge `vllm:kvcr_tier_jobs` (queued or running).
Threading: vLLM's scheduler thread calls the tier; `_run` is the tier's thread.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvcr_core import SlotId
from kvcr_core.attach import (
    ENGINE_KEYS,
    AttachClient,
    EmbeddedRunner,
    EngineSettings,
    Mode,
    RunnerError,
    RunnerOps,
    reject_unknown,
)
from kvcr_core.checksums import block_checksum
from kvcr_core.keys import NamespaceSpec, router_hash_kvcr_v1
from kvcr_core.types import KEY_BYTES, BlockKey

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("kvcr_vllm")
FIELD = "secondary_tiers[KVCRPoolTier]"
MAX_QUEUED_JOBS = 256  # jobs waiting for the tier's thread; more fail at once
STORE_BATCH = 16  # chunks reserved, copied and committed at a time (at most a quarter of
# the pool's slots: a client may hold half of them FILLING or leased)
MAX_KNOWN = 65_536  # chunks known READY (router hashes), the oldest forgotten first
FORGET_EVERY_S = 0.05  # how often the Runner's removal log is read
CHUNKS_METRIC = "vllm:kvcr_tier_chunks"
FAILURES_METRIC = "vllm:kvcr_tier_failures"
JOBS_METRIC = "vllm:kvcr_tier_jobs"
CHUNK_EVENTS = {"stored_chunks": "stored", "promoted_chunks": "promoted",
                "store_refused": "store_refused"}
FRAMEWORK_KEYS = frozenset({"locality"})  # passed through by vLLM's tier factory
T = TypeVar("T")


def tier_namespace(spec: OffloadingSpec, chunk_bytes: int) -> NamespaceSpec:
    """The namespace of an engine's offloaded chunks: everything that makes two engines'
    chunk bytes incompatible (model, dtype, tokens per chunk, parallel layout, layers)."""
    import vllm

    config = spec.config
    parallel = config.parallel
    layers = sum(len(group.layer_names) for group in config.groups)
    tokens = config.groups[0].tokens_per_block * config.cache.blocks_per_chunk
    return NamespaceSpec(
        model_id=config.model.name, dtype=config.model.dtype, kv_dtype=config.model.dtype,
        block_size_tokens=tokens, num_layers=layers, num_kv_heads=1,
        head_dim=1, layout=f"vllm-{vllm.__version__}/offload-chunk",
        tp_size=parallel.tp_size, tp_rank=0,
        extra={"chunk_bytes": str(chunk_bytes), "world_size": str(parallel.world_size),
               "pp_size": str(parallel.pp_size), "dcp_size": str(parallel.dcp_size),
               "pcp_size": str(parallel.pcp_size),
               "kv_cache_layout": str(config.kv_cache_layout or ""),
               "canonical": str(bool(config.canonical_layout)).lower(),
               "groups": ",".join(str(g.tokens_per_block) for g in config.groups)})


def drained(items: collections.deque[T]) -> list[T]:
    """What `items` holds now, taken out (other threads may append meanwhile)."""
    taken = []
    while items:
        taken.append(items.popleft())
    return taken


class KVCRPoolTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.CPU

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview,
                 tier_type: str, backpressure_detector: BackpressureDetector | None = None,
                 **extra: Any) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view,
                         tier_type=tier_type, backpressure_detector=backpressure_detector)
        reject_unknown(extra, FIELD, ENGINE_KEYS, ignored=FRAMEWORK_KEYS)
        engine_id = str(offloading_spec.config.engine_id)
        self.settings = EngineSettings(**EngineSettings.fields_from(
            extra, field=FIELD, default_socket=f"\0kvcr-embedded-tier-{engine_id[:36]}"))
        self.primary = np.asarray(primary_kv_view).view(np.uint8)  # [chunks, chunk bytes]
        self.chunk_bytes = int(self.primary.shape[1])
        self.spec = tier_namespace(offloading_spec, self.chunk_bytes)
        self._root = self.spec.digest()
        identity = self.settings.identity or f"vllm-offload-tier-{engine_id[:12]}"
        self._embedded: EmbeddedRunner | None = None
        self.runner: RunnerOps
        if self.settings.mode is Mode.EMBEDDED:
            self._embedded = EmbeddedRunner(self.settings)
            self.runner = self._embedded.service([self.spec], self.chunk_bytes,
                                                 identity=identity)
        else:
            self.runner = AttachClient(self.settings.socket, self.spec, self.chunk_bytes,
                                       identity=identity, timeout_s=self.settings.timeout_s,
                                       map_pages=True,
                                       runner_uids=self.settings.trusted_runner_uids)
        self.counts: collections.Counter[str] = collections.Counter()
        self._reported: collections.Counter[str] = collections.Counter()  # by get_stats
        self._known: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._events_on = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        self._announced: collections.OrderedDict[int, OffloadKey] = collections.OrderedDict()
        self._events: collections.deque[OffloadingEvent] = collections.deque()
        self._known_lock = threading.Lock()  # the tier's thread remembers what it moved
        self._cursor: tuple[int, int] | None = None  # the removal log's (epoch, batch)
        self._next_forget = 0.0
        self._jobs: queue.Queue[TransferJob | None] = queue.Queue(MAX_QUEUED_JOBS)
        self._done: collections.deque[JobResult] = collections.deque()
        self._idle = threading.Condition()
        self._busy = 0  # jobs queued or running
        self._thread = threading.Thread(target=self._run, name="kvcr-offload-tier",
                                        daemon=True)
        self._thread.start()

    # -- keys --------------------------------------------------------------------------------

    def kvcr_key(self, key: OffloadKey) -> BlockKey:
        """The chunk's kvcr key: vLLM's offload key under this tier's namespace."""
        return BlockKey(hashlib.blake2b(self._root + bytes(key), digest_size=KEY_BYTES).digest())

    # -- the framework's calls (scheduler thread, never blocking on a copy) ------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        kvcr_key = self.kvcr_key(key)
        known = router_hash_kvcr_v1(kvcr_key)
        with self._known_lock:
            if known in self._known:
                self._known.move_to_end(known)
                return LookupResult.HIT
        try:
            found = self.runner.lookup([kvcr_key])
        except RunnerError:
            self.counts["runner_unavailable"] += 1
            return LookupResult.MISS
        if not found:
            return LookupResult.MISS
        self._remember([kvcr_key])
        return LookupResult.HIT

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Forgets the chunks the Runner reports removed (at most every FORGET_EVERY_S)."""
        now = time.monotonic()
        if now < self._next_forget:
            return
        self._next_forget = now + FORGET_EVERY_S
        try:
            if self._cursor is None:
                start = self.runner.removed_since(-1)
                self._cursor = (start.epoch, start.seq)
                self._forget_all()  # what was remembered before is not followed
                return
            answer = self.runner.removed_since(self._cursor[1])
        except RunnerError:
            self.counts["runner_unavailable"] += 1
            self._forget_all()  # a Runner gone (restarting) may come back empty
            self._cursor = None
            return
        if answer.epoch != self._cursor[0] or answer.reset:
            self._forget_all()  # restarted, or the log no longer reaches back
        else:
            gone = []
            with self._known_lock:
                for removed in answer.hashes[0]:
                    self._known.pop(removed, None)
                    key = self._announced.pop(removed, None)
                    if key is not None:
                        gone.append(key)
            self._announce(gone, removed=True)
        self._cursor = (answer.epoch, answer.seq)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return drained(self._events)

    def _forget_all(self) -> None:
        with self._known_lock:
            self._known.clear()
            gone = list(self._announced.values())
            self._announced.clear()
        self._announce(gone, removed=True)

    def _announce(self, keys: list[OffloadKey], *, removed: bool) -> None:
        if self._events_on and keys:
            self._events.append(OffloadingEvent(keys=keys, medium=Medium.CPU, removed=removed,
                                                ownership=self.tier_type))

    def _stored(self, chunks: list[tuple[BlockKey, OffloadKey]]) -> None:
        """Chunks this tier committed: announced stored (with KV events on)."""
        if not self._events_on:
            return
        with self._known_lock:
            for kvcr_key, key in chunks:
                self._announced[router_hash_kvcr_v1(kvcr_key)] = key
            dropped = []
            while len(self._announced) > MAX_KNOWN:  # no longer followed: announced removed
                dropped.append(self._announced.popitem(last=False)[1])
        self._announce([key for _, key in chunks], removed=False)
        self._announce(dropped, removed=True)

    def _remember(self, keys: Iterable[BlockKey]) -> None:
        with self._known_lock:
            for key in keys:
                self._known[router_hash_kvcr_v1(key)] = None
                self._known.move_to_end(router_hash_kvcr_v1(key))
            while len(self._known) > MAX_KNOWN:
                self._known.popitem(last=False)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return drained(self._done)

    def has_pending_work(self) -> bool:
        return self._busy > 0 or bool(self._done)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return {
            CHUNKS_METRIC: OffloadingCounterMetadata(
                documentation="Chunks kvcr's tier stored (cascaded from vLLM's primary tier), "
                "promoted back into it, or was refused room for", labelnames=("event",)),
            FAILURES_METRIC: OffloadingCounterMetadata(
                documentation="kvcr tier faults, each a miss or a failed job (a recompute), "
                "by reason", labelnames=("reason",)),
            JOBS_METRIC: OffloadingGaugeMetadata(
                documentation="kvcr tier jobs queued or running")}

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What was counted since the last call, and the jobs in flight now."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        now = collections.Counter(self.counts)  # (a snapshot: the tier's thread counts too)
        stats = OffloadingConnectorStats()
        for name, n in (now - self._reported).items():
            event = CHUNK_EVENTS.get(name)
            stats.increase_counter(CHUNKS_METRIC if event else FAILURES_METRIC, n,
                                   (event or name,))
        self._reported = now
        stats.set_gauge(JOBS_METRIC, self._busy)
        return stats

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0)

    def shutdown(self) -> None:
        """Finishes queued jobs, then closes the Runner's connection (or the embedded Runner)."""
        self.drain_jobs()
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self.primary = np.empty((0, self.chunk_bytes), np.uint8)  # vLLM unmaps the primary next
        self.runner.close()
        if self._embedded is not None:
            self._embedded.stop()

    # -- jobs (the tier's thread) -------------------------------------------------------------

    def _submit(self, job: TransferJob) -> None:
        with self._idle:
            self._busy += 1
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self.counts["queue_full"] += 1
            self._finish(JobResult(job.job_id, success=False))

    def _finish(self, result: JobResult) -> None:
        self._done.append(result)
        with self._idle:
            self._busy -= 1
            self._idle.notify_all()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            start = time.perf_counter()
            try:
                result = self._load(job) if job.is_promotion else self._store(job)
            except Exception as exc:  # a kvcr fault fails the job, never the scheduler
                self.counts["promotion_failed" if job.is_promotion else "store_failed"] += 1
                if not isinstance(exc, RunnerError):
                    log.error("kvcr offload tier: job %d failed (%s)", job.job_id, exc)
                result = JobResult(job.job_id, success=False)
            result.transfer_time = time.perf_counter() - start
            self._finish(result)

    def _store(self, job: TransferJob) -> JobResult:
        """Reserves, copies, hashes and commits `STORE_BATCH` chunks at a time (a client's
        slots in FILLING are bounded: a whole job at once could be refused in part)."""
        offload_keys = list(job.keys)
        keys = [self.kvcr_key(k) for k in offload_keys]
        chunks = [int(c) for c in job.chunk_ids]
        stored = refused = 0
        pool = self.runner.pool()
        batch = max(1, min(STORE_BATCH, pool.capacity_slots // 4))  # (a client may hold half)
        for start in range(0, len(keys), batch):
            reservation = self.runner.reserve(keys[start:start + batch])
            granted = [(slot, chunk) for slot, chunk in
                       zip(reservation.slots, chunks[start:start + batch], strict=True)
                       if slot is not None]
            sums = []
            try:
                for slot, chunk in granted:
                    view = pool.view(SlotId(slot))
                    np.frombuffer(view, np.uint8)[:self.chunk_bytes] = self.primary[chunk]
                    sums.append(block_checksum(self.primary[chunk].data))  # the source's:
                    # (a process of another uid mapping the pool could change the slot)
            except BaseException:
                self.runner.abort(reservation.op)  # nothing half-written is published
                raise
            if granted:
                self.runner.commit(reservation.op, sums)
                new = [start + i for i, slot in enumerate(reservation.slots) if slot is not None]
                self._remember(keys[i] for i in new)
                self._stored([(keys[i], offload_keys[i]) for i in new])
            stored += len(granted)
            refused += reservation.refused
        self.counts["stored_chunks"] += stored
        if refused:
            self.counts["store_refused"] += refused
        return JobResult(job.job_id, success=not refused,
                         transfer_bytes=stored * self.chunk_bytes)

    def _load(self, job: TransferJob) -> JobResult:
        offload_keys = list(job.keys)
        lease = self.runner.acquire([self.kvcr_key(k) for k in offload_keys], prefix_only=False)
        if lease.granted < len(offload_keys):  # gone since a lookup said HIT: forget them
            with self._known_lock:
                for key, slot in zip(offload_keys, lease.slots, strict=True):
                    if slot is None:
                        self._known.pop(router_hash_kvcr_v1(self.kvcr_key(key)), None)
        pool = self.runner.pool()
        loaded = []
        try:
            for key, slot, chunk in zip(offload_keys, lease.slots, job.chunk_ids, strict=True):
                if slot is None:
                    continue
                view = pool.view(SlotId(slot))
                self.primary[int(chunk)] = np.frombuffer(view, np.uint8)[:self.chunk_bytes]
                loaded.append(key)
        finally:
            self.runner.release(lease.op)
        self.counts["promoted_chunks"] += len(loaded)
        whole = len(loaded) == len(offload_keys)
        return JobResult(job.job_id, success=whole,
                         successful_keys=None if whole else loaded,
                         transfer_bytes=len(loaded) * self.chunk_bytes)
