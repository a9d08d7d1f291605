"""`KVCRConnector`: the class vLLM loads. It only dispatches by role (as vLLM's own connectors
do): the
scheduler side (`KVCRConnectorScheduler`) in the EngineCore process, the worker side
(`KVCRConnectorWorker`) in each worker. Engine config is translated once (`settings`).

Use it with `--kv-transfer-config '{"kv_connector":"KVCRConnector","kv_role":"kv_both"}'`
(the `vllm.general_plugins` entry point registers the name) or with
`"kv_connector_module_path":"kvcr_vllm.connector"`. See docs/vllm.md.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcr_core.attach import AttachClient, Mode, RunnerOps, probe_status
from kvcr_vllm import SUPPORTED_VLLM_TEXT, supports_vllm
from kvcr_vllm.metadata import KVCRConnectorMetadata
from kvcr_vllm.plugin import follow_vllm_logging
from kvcr_vllm.router_tier import guard_endpoint_problem
from kvcr_vllm.settings import ConnectorSettings, engine_namespaces, kv_groups
from kvcr_vllm.stats import KVCRConnectorStats, KVCRPromMetrics, StatsRecorder

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvcr_core.attach import EmbeddedRunner
    from kvcr_vllm.scheduler import KVCRConnectorScheduler

log = logging.getLogger("kvcr_vllm")
STARTUP_ATTACH_TIMEOUT_S = 60.0  # a Runner opening (and prefaulting) a large namespace pool


def check_vllm_version() -> None:
    if not supports_vllm(vllm.__version__):
        raise RuntimeError(
            f"kvcr-vllm supports vLLM {SUPPORTED_VLLM_TEXT}; this is "
            f"vLLM {vllm.__version__}. Run a supported vLLM, install kvcr-vllm from a revision "
            "of this repository that supports this one (it is not on PyPI: pip install "
            "./packages/kvcr-vllm in a clone of https://github.com/kvcr-project/kvcr), or remove "
            "KVCRConnector from --kv-transfer-config.")


def attach_at_start(clients: Iterable[AttachClient], socket: str) -> None:
    """Attaches at engine start, so the first request pays no attach: the namespace opens
    (a `--prefault` kvcr-guard backs its whole pool then, seconds for large pools, unless it
    backed it at its own start) and the pool is mapped. A Runner not there yet is no error:
    the first use attaches."""
    for client in clients:
        if not client.try_attach(STARTUP_ATTACH_TIMEOUT_S):
            log.info("kvcr: no Runner answering at %s yet; attaching on first use", socket)
            return


class KVCRConnector(KVConnectorBase_V1, SupportsHMA):
    """`SupportsHMA`: hybrid models (sliding-window or chunked-local layers beside full
    attention) keep vLLM's hybrid memory manager; each KV cache group's blocks are kept in a
    namespace of their own (kvcr_vllm.settings.namespaces_for)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_vllm_version()
        follow_vllm_logging()  # also when loaded by kv_connector_module_path, not the plugin
        transfer = self._kv_transfer_config
        engine_id = str(transfer.engine_id or "kvcr")
        dp_rank = getattr(vllm_config.parallel_config, "data_parallel_rank_local", 0)
        self.settings = ConnectorSettings.from_extra_config(
            transfer.kv_connector_extra_config or {}, engine_id, dp_rank or 0)
        self.stats = StatsRecorder()
        self.groups = kv_groups(kv_cache_config,
                                str(getattr(vllm_config.model_config.hf_config, "model_type", "")))
        block_bytes = self.groups[0].block_bytes
        self.namespaces = engine_namespaces(vllm_config, self.groups)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._scheduler: KVCRConnectorScheduler | None = None
        self._worker = None
        self._embedded: EmbeddedRunner | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._start_scheduler(vllm_config, block_bytes, engine_id,
                                                    dp_rank or 0)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from kvcr_vllm.worker import KVCRConnectorWorker

            rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
            self._worker = KVCRConnectorWorker(
                self.settings, self.namespaces.of_rank(rank), rank, block_bytes,
                kv_cache_config.num_blocks, self.stats, engine_id,
                groups=[group.layer_names for group in self.groups],
                writes=[self.namespaces.writes(rank, g) for g in range(len(self.groups))])

    def _start_scheduler(self, vllm_config: VllmConfig, block_bytes: int, engine_id: str,
                         dp_rank: int) -> KVCRConnectorScheduler:
        """The scheduler side, with one `RunnerOps` for every TP rank's namespace: the
        embedded Runner started here, called in-process; or kvcr-guard's, attached now."""
        from kvcr_vllm.scheduler import KVCRConnectorScheduler

        transfer = self._kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            log.info("kvcr: kv_load_failure_policy=recompute (a cache fault must never "
                     "fail a request)")
            transfer.kv_load_failure_policy = "recompute"
        specs = list(self.namespaces.specs)
        identity = self.settings.identity or f"vllm-scheduler-{engine_id[:12]}"
        runner: RunnerOps | None = None
        if self.settings.mode is Mode.EMBEDDED:
            from kvcr_core.attach import EmbeddedRunner

            self._embedded = EmbeddedRunner(self.settings)
            runner = self._embedded.service(specs, block_bytes, identity=identity)
            # the workers learn the socket (its random part) from the step's metadata
            self.settings = dataclasses.replace(self.settings, socket=self._embedded.socket_path)
        elif self.settings.router_hint is not None:
            self._check_guard_endpoint(dp_rank)
        events = vllm_config.kv_events_config
        scheduler = KVCRConnectorScheduler(
            self.settings, specs, block_bytes, self.stats, engine_id, runner=runner,
            peer_endpoint=self._embedded.peer_endpoint if self._embedded else None,
            publish_events=bool(events is not None and events.enable_kv_cache_events),
            namespaces=self.namespaces,
            synchronous_loads=vllm_config.device_config.device_type == "cpu")
        if isinstance(scheduler.runner, AttachClient):
            attach_at_start([scheduler.runner], self.settings.socket)
        return scheduler

    def _check_guard_endpoint(self, dp_rank: int) -> None:
        """Guarded mode with Dynamo's hint capability: warn when the advertised control port
        is not kvcr-guard's peer port (peers would fetch from nowhere). Advisory: a guard
        that cannot be asked now (down, restarting) is no error."""
        assert self.settings.router_hint is not None
        try:
            status = probe_status(self.settings.socket, timeout_s=1.0)
        except Exception as exc:  # any failure only skips this advisory check
            log.info("kvcr: could not ask kvcr-guard for its peer endpoint (%s); not checking "
                     "secondary_tiers' control_ports", exc)
            return
        problem = guard_endpoint_problem(self.settings.router_hint, dp_rank, status)
        if problem is not None:
            log.warning("kvcr: %s", problem)

    # -- properties ----------------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, nothing more

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)
        if self.settings.mode is Mode.GUARDED:  # an embedded Runner starts after this, with
            attach_at_start([self._worker.client], self.settings.socket)  # the scheduler

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVCRConnectorMetadata):
            self._worker.bind(connector_metadata)  # the step's saves reserve now

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVCRConnectorMetadata)
        self._worker.start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads copy whole blocks in start_load_kv, before the forward pass

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.report()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Asynchronous (CUDA) copies start saving this layer while the forward goes on;
        inline (CPU) copies save every layer in `wait_for_save`."""
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        if isinstance(metadata, KVCRConnectorMetadata):  # not a dummy run's empty metadata
            self._worker.save_kv_layer(metadata, layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVCRConnectorMetadata)
        self._worker.wait_for_save(metadata)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._embedded is not None:
            self._embedded.stop()

    # -- scheduler side ------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call when its hybrid memory manager is on (any model, one group or more)."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids[0] if block_ids else [])

    def take_events(self) -> Iterable[KVCacheEvent]:
        assert self._scheduler is not None
        return self._scheduler.take_events()

    def reset_cache(self) -> bool | None:
        """vLLM reset its prefix cache: kvcr's pool stays (it is the tier that outlives
        vLLM's), and its blocks are announced again after vLLM's AllBlocksCleared."""
        if self._scheduler is not None and self._scheduler.events is not None:
            self._scheduler.events.announce_again()
        return None

    # -- metrics -------------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVCRConnectorStats(data=data) if data is not None else KVCRConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KVCRPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
