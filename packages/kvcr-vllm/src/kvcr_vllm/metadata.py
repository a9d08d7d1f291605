"""Plain-data plans the scheduler side sends to the workers inside vLLM's connector
metadata. Picklable: ids, slots and keys only, no handles, no tensors.

Per TP rank and KV cache group: each has its own namespace, so its own keys and slots.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """Copy pool slots into vLLM blocks; `failed_block_ids` could not be leased (recompute).
    `checksums_by_rank`: each slot's committed checksum, when loads are verified.
    `synchronous`: the request runs in the step that loads it (the copy precedes the
    forward pass; the workers report it done in their `WorkerReport`), else it waits in vLLM's
    WAITING_FOR_REMOTE_KVS until the workers report it through `get_finished`. `group`: the
    KV cache group whose blocks these are (a request has one plan per group; the workers
    report it loaded once every plan is)."""

    req_id: str
    block_ids: tuple[int, ...]
    slots_by_rank: tuple[tuple[int, ...], ...]
    failed_block_ids: tuple[int, ...] = ()
    checksums_by_rank: tuple[tuple[int, ...], ...] = ()
    synchronous: bool = False
    group: int = 0


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """Blocks whose KV this step completes: each worker reserves their keys in its rank's
    namespace of the plan's KV cache `group`, copies the blocks it was granted and commits
    them."""

    req_id: str
    block_ids: tuple[int, ...]
    keys_by_rank: tuple[tuple[bytes, ...], ...]
    group: int = 0


@dataclasses.dataclass
class KVCRConnectorMetadata(KVConnectorMetadata):
    """`runner_socket`: where the workers attach (an embedded Runner's socket ends in a
    random part only the scheduler side knows: no other uid can bind it first)."""

    loads: list[LoadPlan] = dataclasses.field(default_factory=list)
    saves: list[SavePlan] = dataclasses.field(default_factory=list)
    runner_socket: str = ""


@dataclasses.dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler, with a step's output: the requests whose synchronous loads this
    step copied (`loads_done`), and the keys whose saves each worker committed since its last
    report (`saved_keys`, every rank's namespace keys together). `suspect`: a worker's
    connection re-attached, or learnt that a commit it reported published nothing: what was
    reported saved before may not all be in kvcr. vLLM hands the scheduler one step's
    reports once every TP rank finished that step, aggregated (`aggregate`: the union)."""

    loads_done: frozenset[str] = frozenset()
    saved_keys: frozenset[bytes] = frozenset()
    suspect: bool = False

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, WorkerReport):
            return self
        return WorkerReport(self.loads_done | other.loads_done,
                            self.saved_keys | other.saved_keys, self.suspect or other.suspect)
