"""`KVCRConnectorScheduler`: the connector's scheduler side (vLLM's EngineCore process).

Decides, per request, which blocks to load from kvcr and which to save, and hands workers
plain-data plans (kvcr_vllm.metadata). It never touches KV bytes.

- Keys: kvcr block keys of the request's tokens (docs/keys.md), one chain per namespace (one
  per TP rank and KV cache group: a hybrid model's sliding-window and full-attention groups
  have their own blocks, so their own namespaces; an MLA group's latent KV, the same on
  every rank, one namespace for all: kvcr_vllm.settings.EngineNamespaces), rooted in the
  context (kvcr_vllm.request_context: its cache salt and LoRA adapter's content), so
  requests of another salt or adapter never share KV. Requests whose KV depends on what kvcr
  cannot name (prompt embeddings, an adapter not yet hashed or not a local directory) bypass
  kvcr, counted: nothing wrong is ever served. Blocks that hold a multimodal input's
  placeholder tokens carry its identifier and offset.
- Load: `get_num_new_matched_tokens` looks up blocks beyond vLLM's own prefix hit.
  `update_state_after_alloc` leases the blocks (no eviction while loading) and plans the copy;
  leases are released when the workers report the load done. A prefix is a hit when every
  namespace holds all its blocks; each group's plan copies the blocks vLLM allocated for it
  (a sliding-window group's blocks outside the window are vLLM's null block: leased, so kept
  warm with the prefix, never copied). Host KV caches load
  synchronously (`(n, False)`): the workers copy before the forward pass of the step that
  runs the request, so a hit costs no extra engine step (an asynchronous load parks the
  request for a whole step, which under load is another batch's forward pass); at most
  `num_tokens - 1` tokens, vLLM computes the last one. Device caches answer asynchronously
  (`(n, True)`, the whole prompt; vLLM recomputes the last token itself).
- Save: every step, the full blocks whose KV the step completes (prompt and generated tokens;
  the partial last block never) are planned; each worker reserves, copies and commits them
  itself right after that step's forward pass, so KV is reusable by other engines while the
  request still decodes, and a finished request's blocks can be freed at once.
- The Runner: one `RunnerOps` for every TP rank's namespace: the embedded Runner in-process,
  or kvcr-guard through one `AttachClient`; a lookup, a lease and a peer fetch each cover
  every rank in one call (one round trip in guarded mode, whatever the TP size).
- Hints and pull on miss (kvcr_vllm.fetches): a hint (vLLM's `Request.kv_hints`, as Dynamo
  sends it, or `kv_transfer_params["kv_hint"]`) naming an allowed peer makes the scheduler
  fetch the hinted blocks that extend kvcr's local prefix into every rank's namespace,
  answering "ask again" (None) until the fetch ends, which it does by `fetch_deadline_s`;
  without a hint, when kvcr's local prefix stops short of the prompt, the run a followed peer
  holds. Then the normal lookup and load follow (no lookup when the fetch completed the
  prompt: the lease checks).
- Saves report back like loads: each worker's `WorkerReport` (vLLM's worker metadata) names
  the keys it committed; with vLLM's KV events on, those blocks (READY on every rank) and
  the blocks fetched from peers are announced as a host tier (`CPU_PINNED`), and announced
  removed as the Runner's inventory log says kvcr evicted them (kvcr_vllm.pool_events), so a
  KV-aware router credits kvcr's pool.
- Faults (daemon down, eviction races) degrade to recompute and are counted by reason.
Threading: vLLM calls these from its scheduler thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvcr_core.attach import AttachClient, FetchSummary, RunnerError, RunnerOps
from kvcr_core.config import verifies_loads
from kvcr_core.hints import HintIntake, HintLimits
from kvcr_core.keys import NamespaceSpec, block_keys_with, context_root
from kvcr_core.types import BlockKey, OpId
from kvcr_vllm.fetches import RequestFetches, RequestState
from kvcr_vllm.metadata import KVCRConnectorMetadata, LoadPlan, SavePlan, WorkerReport
from kvcr_vllm.pool_events import PoolEvents
from kvcr_vllm.request_context import LoraDigests, mm_block_extras, request_context
from kvcr_vllm.request_hints import raw_hint
from kvcr_vllm.settings import ConnectorSettings, EngineNamespaces
from kvcr_vllm.stats import StatsRecorder

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvcr_vllm")
NULL_BLOCK = 0  # vLLM's null block (a sliding-window group's blocks outside the window)


def announced(state: RequestState) -> bool:
    """Whether the request's blocks go into KV events: not a salted, LoRA or multimodal
    request's (a router matching events by token ids could credit them to other requests)."""
    return not state.context and not getattr(state.request, "mm_features", None)


class KVCRConnectorScheduler:
    def __init__(self, settings: ConnectorSettings, specs: list[NamespaceSpec],
                 block_bytes: int, stats: StatsRecorder, engine_id: str, *,
                 peer_endpoint: str | None = None, runner: RunnerOps | None = None,
                 publish_events: bool = False, synchronous_loads: bool = False,
                 namespaces: EngineNamespaces | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """`runner`: the Runner's operations for every rank's namespace, in rank order (the
        embedded Runner in-process; tests give theirs); None: kvcr-guard's, through one
        `AttachClient`. `clock` and `sleep` time the fetch waits; the embedded Runner's
        `peer_endpoint` is reported in each finished request's params; `publish_events`:
        announce kvcr's blocks in vLLM's KV events (kvcr_vllm.pool_events);
        `synchronous_loads`: load in the step that runs the request (host KV caches);
        `namespaces`: which of `specs` holds each rank's blocks of each KV cache group
        (default: one group, rank r's in specs[r])."""
        self.settings = settings
        self.specs = specs
        self.namespaces = namespaces or EngineNamespaces.of([[spec] for spec in specs])
        self.block_size = specs[0].block_size_tokens
        self.block_bytes = block_bytes
        self.stats = stats
        identity = settings.identity or f"vllm-scheduler-{engine_id[:12]}"
        self.runner: RunnerOps = runner if runner is not None else AttachClient(
            settings.socket, specs, block_bytes, identity=identity, timeout_s=settings.timeout_s,
            runner_uids=settings.trusted_runner_uids)
        self.fetches = RequestFetches(settings, self.runner, stats, block_bytes, len(specs),
                                      clock, sleep, self._fetched)
        self.peer_endpoint = peer_endpoint
        self.synchronous_loads = synchronous_loads
        runner_config = settings.runner
        self.hints = HintIntake(stats, HintLimits(max_actions=runner_config.max_hint_actions,
                                                  max_hashes=runner_config.max_hint_hashes,
                                                  max_bytes=runner_config.max_hint_bytes))
        self._requests: dict[str, RequestState] = {}
        self.lora = LoraDigests()  # adapters' content digests, for LoRA requests' keys
        self._pending_loads: list[LoadPlan] = []
        self.events = PoolEvents(self.runner, self.block_size, clock=clock) \
            if publish_events else None

    # -- keys ----------------------------------------------------------------------------------

    def _state(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            context, bypass = request_context(request, self.lora)
            state = RequestState(request, bypass, context)
            self._requests[request.request_id] = state
            if state.bypass:
                self.stats.count("bypassed", state.bypass)
        return state

    def _keys(self, state: RequestState, n_blocks: int) -> list[list[BlockKey]]:
        """Keys of the first `n_blocks` blocks per rank, extended incrementally."""
        if n_blocks > state.keyed_blocks:
            bs, first = self.block_size, state.keyed_blocks
            tokens = list(state.request.all_token_ids[first * bs:n_blocks * bs])
            extras = mm_block_extras(state.request, first, n_blocks, bs)
            if not state.keys:
                state.keys = [[] for _ in self.specs]
            for rank, spec in enumerate(self.specs):
                chain = state.keys[rank]
                parent = chain[-1] if chain else context_root(spec.digest(), state.context)
                chain.extend(block_keys_with(parent, tokens, bs, extras))
            state.keyed_blocks = len(state.keys[0])
        return [chain[:n_blocks] for chain in state.keys]

    def _prompt_keys(self, state: RequestState) -> list[list[BlockKey]]:
        return self._keys(state, state.request.num_tokens // self.block_size)

    # -- requests ------------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        state = self._state(request)
        # vLLM's Request.kv_hints (Dynamo), else kv_transfer_params["kv_hint"] (anything a
        # client put in vllm_xargs): the same intake validates and counts both
        raw = raw_hint(request)
        if raw is not None:
            state.hint = self.hints.accept(raw)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if state.bypass or not self.settings.load:
            return 0, False
        if state.wants_fetch and self.fetches.pending(state, lambda: self._prompt_keys(state)):
            return None, False  # a peer fetch runs: ask again next step (bounded by deadline)
        bs = self.block_size
        # A hit may cover the whole prompt: after an async load vLLM recomputes the last
        # token itself (so it can sample the next one).
        n_blocks = request.num_tokens // bs
        local_blocks = num_computed_tokens // bs
        fetched, state.fetched_through = state.fetched_through, 0  # good for this decision only
        if n_blocks <= local_blocks:
            return 0, False
        keys = self._keys(state, n_blocks)
        if fetched >= n_blocks:
            hit = n_blocks  # a fetch just completed the prompt: no lookup (the lease checks)
        else:
            try:
                hit = self.runner.lookup_all(keys)
            except RunnerError:
                self.stats.failure("guard_unavailable")
                return 0, False
        self.stats.add("lookups")  # (the alerts' denominator: one per decision either way)
        if hit < n_blocks and self.fetches.may_pull(state) and \
                self.fetches.start_pull(state, keys, hit):
            if self.fetches.waited(state):
                return None, False  # pulling the run a peer holds: ask again next step
            return self.get_num_new_matched_tokens(request, num_computed_tokens)
        if hit <= local_blocks:
            return 0, False
        state.local_tokens = num_computed_tokens
        if self.synchronous_loads:  # the step that loads computes at least the last token
            return min(hit * bs, request.num_tokens - 1) - num_computed_tokens, False
        return hit * bs - num_computed_tokens, True

    def _fetched(self, state: RequestState, summary: FetchSummary) -> None:
        """A fetch made blocks READY: announce those every rank holds now."""
        if self.events is not None and announced(state):
            self.events.fetched(state.request, summary.run.start,
                                self._keys(state, summary.run.end), summary.statuses)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        state = self._state(request)
        bs = self.block_size
        first = state.local_tokens // bs
        count = -(-num_external_tokens // bs)
        ids = [list(group[first:first + count]) for group in blocks.get_block_ids()]
        keys = [k[first:first + count] for k in self._keys(state, first + count)]
        verify = verifies_loads(self.settings.runner.verify_loads, self.runner.shared)
        try:
            leases = self.runner.acquire_all(keys, checksums=verify)
            ops = [lease.op for lease in leases]
            slots = [lease.slots for lease in leases]
            sums = [lease.checksums for lease in leases]
        except RunnerError:
            self.stats.failure("guard_unavailable")
            ops, slots, sums = [], [(None,) * count for _ in self.specs], []
        granted = min(next((i for i, s in enumerate(r) if s is None), len(r)) for r in slots)
        if granted < count and self.namespaces.groups > 1:
            granted = 0  # a hybrid model's partial hit would leave the window's blocks of its
            # new end unloaded (vLLM allocated those of the planned end): recompute it all
        if granted < count:
            self.stats.failure("evicted_before_load", count - granted)
        state.loading_ops = ops
        state.loaded_tokens = min(granted * bs, num_external_tokens)
        state.planned_blocks = max(state.planned_blocks, first + granted)  # already in kvcr
        self.stats.add("lookup_hit_tokens", num_external_tokens)
        for g, group_ids in enumerate(ids):
            ns = self.namespaces.of_group(g)  # this group's namespace of each rank
            copy = [i for i in range(min(granted, len(group_ids))) if group_ids[i] != NULL_BLOCK]
            self._pending_loads.append(LoadPlan(
                request.request_id, tuple(group_ids[i] for i in copy),
                tuple(tuple(int(slots[n][i]) for i in copy) for n in ns),  # type: ignore[arg-type]
                tuple(b for b in group_ids[granted:] if b != NULL_BLOCK),
                tuple(tuple(sums[n][i] for i in copy) for n in ns) if verify else (),
                self.synchronous_loads, group=g))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVCRConnectorMetadata:
        meta = KVCRConnectorMetadata(self._pending_loads, [], self.settings.socket)
        self._pending_loads = []
        if self.settings.save:
            scheduled = scheduler_output.num_scheduled_tokens
            for new in scheduler_output.scheduled_new_reqs:
                state = self._requests.get(new.req_id)
                if state is not None:
                    state.block_ids = [list(group) for group in new.block_ids]
                    self._plan_saves(state, new.num_computed_tokens + scheduled[new.req_id], meta)
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                state = self._requests.get(req_id)
                if state is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if req_id in cached.resumed_req_ids:
                    state.block_ids = [list(group) for group in new_ids or ()]
                elif new_ids:
                    if not state.block_ids:
                        state.block_ids = [[] for _ in new_ids]
                    for have, more in zip(state.block_ids, new_ids, strict=True):
                        have.extend(more)
                self._plan_saves(state, cached.num_computed_tokens[i] + scheduled[req_id], meta)
        return meta

    def _plan_saves(self, state: RequestState, tokens_done: int,
                    meta: KVCRConnectorMetadata) -> None:
        """Plans the full blocks this step completes that kvcr may lack: per KV cache group,
        those vLLM holds a block for (not a sliding-window group's null blocks)."""
        if state.bypass or not state.block_ids:
            return
        full = min(tokens_done // self.block_size, *(len(ids) for ids in state.block_ids))
        if full <= state.planned_blocks:
            return
        first = state.planned_blocks
        keys = self._keys(state, full)
        for g, group_ids in enumerate(state.block_ids):
            saved = [i for i in range(first, full) if group_ids[i] != NULL_BLOCK]
            if saved:
                meta.saves.append(SavePlan(
                    state.request.request_id, tuple(group_ids[i] for i in saved),
                    tuple(tuple(keys[n][i] for i in saved)
                          for n in self.namespaces.of_group(g)), group=g))
        state.planned_blocks = full
        if self.events is not None and announced(state):
            self.events.planned(state.request, first, full, keys)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        report = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(report, WorkerReport):
            report = None
        if report is not None and self.events is not None:
            self.events.saved(report.saved_keys, suspect=report.suspect)
        loaded = report.loads_done if report is not None else ()
        for req_id in (*(output.finished_recving or ()), *loaded):
            state = self._requests.get(req_id)
            if state is None:
                continue
            if state.loading_ops is not None:
                self._release_all(state.loading_ops)
                state.loading_ops = None
            if state.finished:
                del self._requests[req_id]

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.get(request.request_id)
        if state is None:
            return False, None
        params: dict[str, Any] = {"kvcr_loaded_tokens": state.loaded_tokens,
                                  "kvcr_saved_blocks": state.planned_blocks}
        if self.peer_endpoint is not None:
            params["kvcr_peer_endpoint"] = self.peer_endpoint
        if state.loading_ops is not None:
            # Finished (aborted) while its load runs: vLLM frees the blocks once the workers
            # report the load, and the leases are released then.
            state.finished = True
        else:
            del self._requests[request.request_id]
        # Saves complete inside the step that planned them: nothing holds the blocks.
        return False, params

    def take_events(self) -> list[KVCacheEvent]:
        """kvcr's pool tier as vLLM KV events since the last call (none unless enabled)."""
        if self.events is None:
            return []
        lost = self.events.lost_runner
        events = self.events.take()
        if self.events.lost_runner > lost:
            self.stats.failure("guard_unavailable")
        return events

    def _release_all(self, ops: list[OpId]) -> None:
        for ns, op in enumerate(ops):
            try:
                self.runner.release_nowait(op, ns)
            except RunnerError:
                self.stats.failure("guard_unavailable")

    def shutdown(self) -> None:
        self.runner.close()
