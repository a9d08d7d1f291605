"""`SavePipeline`: the worker side's saves, one vLLM step at a time.

A step's saves are reserved as soon as its metadata is bound (one overlapped round trip for
all of the step's plans, while the forward runs). Their blocks are copied into the granted
slots layer by layer, as vLLM's `save_kv_layer` hands each layer over, when the copy engine
is asynchronous (CUDA: the copies overlap the forward); otherwise (inline CPU copies), and for
any layer the forward did not hand over, all at once in `wait_for_save`. The step's copies
then get one job (`record`: a CUDA event), and `fence` orders vLLM's later device work after
them, so a block freed at the end of this step is not overwritten before its copy read it
(vLLM requires async savers to keep their source blocks; here the device keeps the order and
the host never waits). Once its step's job completed (polled at each hook, never waited for
in the forward) each save is sealed (kvcr_core.sealing): its blocks are hashed from the slots,
every layer in, on the sealer's threads, and committed with those checksums from there, so
neither the forward nor the worker thread waits for a hash; a block is READY only after all
its bytes landed and were hashed. A save whose copy fails,
or whose attachment changed under it (its slots belong to an earlier mapping), is aborted,
never published. The keys committed go to the scheduler in the worker's next report
(`take_report`), as loads do: saves report back, nothing polls.

Threading: vLLM's worker thread, except `_publish` (the sealer's threads), which hands its
outcome back through a deque that the worker thread drains.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from kvcr_core import BlockKey, OpId, Reservation, SlotId
from kvcr_core.attach import Handle, RunnerError, RunnerOps, RunnerUnavailable
from kvcr_core.copyengine import BlockCopy, CopyFailed, CopyJob, PoolBinding, copy_calls
from kvcr_core.sealing import Sealer
from kvcr_vllm.metadata import KVCRConnectorMetadata, SavePlan
from kvcr_vllm.stats import StatsRecorder

if TYPE_CHECKING:
    from kvcr_core.copyengine import Plane

log = logging.getLogger("kvcr_vllm")


@dataclasses.dataclass
class _Save:
    plan: SavePlan
    reservation: Handle[Reservation] | None
    attach: int = -1  # the attachment its slots belong to
    op: OpId | None = None
    blocks: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()
    keys: tuple[bytes, ...] = ()  # of the granted blocks
    failed: bool = False


@dataclasses.dataclass
class _Step:
    metadata: KVCRConnectorMetadata
    saves: list[_Save]
    resolved: bool = False
    layers: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    job: CopyJob | None = None

    def live(self) -> list[_Save]:
        return [s for s in self.saves if s.blocks and not s.failed]


class SavePipeline:
    def __init__(self, client: RunnerOps, binding: PoolBinding,
                 layers: list[dict[str, list[Plane]]], tp_rank: int, block_tokens: int,
                 stats: StatsRecorder, sealer: Sealer, writes: list[bool] | None = None) -> None:
        """`layers`: per KV cache group (the client's namespace of the same index), its
        layers' planes; `writes`: per group, whether this rank saves it (default: all)."""
        self.client = client
        self.sealer = sealer
        self.binding = binding
        self.engine = binding.engine
        self.layers = layers
        self.group_of = {name: g for g, group in enumerate(layers) for name in group}
        self.writes = writes or [True] * len(layers)
        self.tp_rank = tp_rank
        self.block_tokens = block_tokens
        self.stats = stats
        self._step: _Step | None = None
        self._pending: collections.deque[_Step] = collections.deque()
        self._saved: list[bytes] = []  # keys committed since the last report
        self._sealed: collections.deque[tuple[_Save, BaseException | None]] = \
            collections.deque()  # saves the sealer committed (or failed to), not yet counted
        self._reported_attach = -1  # the attachment the last report was about

    @property
    def in_flight(self) -> int:
        """Steps copied (or copying) whose saves are not committed yet."""
        return len(self._pending)

    # -- per step ------------------------------------------------------------------------------

    def begin(self, metadata: KVCRConnectorMetadata) -> _Step:
        """Reserves the step's keys (once per bound metadata)."""
        step = self._step
        if step is not None and step.metadata is metadata:
            return step
        if step is not None:  # a step vLLM never finished: finish it now
            self.finish(step.metadata)
        saves = []
        for plan in metadata.saves:
            if not self.writes[plan.group]:
                continue  # another rank writes this group's shared namespace
            keys = cast("Sequence[BlockKey]", plan.keys_by_rank[self.tp_rank])
            try:
                saves.append(_Save(plan, self.client.reserve_async(keys, plan.group),
                                   self.client.attach_count))
            except Exception as exc:  # a kvcr fault never reaches vLLM: the save is lost
                save = _Save(plan, None)
                self._fail(save, exc)
                saves.append(save)
        self._step = _Step(metadata, saves)
        return self._step

    def save_layer(self, metadata: KVCRConnectorMetadata, layer_name: str) -> None:
        """Copies one layer of the step's granted blocks (asynchronous engines)."""
        group = self.group_of.get(layer_name)
        if group is None or not metadata.saves:
            return
        step = self.begin(metadata)
        step.layers[layer_name] += 1
        if step.layers[layer_name] == 1:
            self._resolve(step)
            self._copy(step, group, self.layers[group][layer_name])
        # A second forward in the step rewrote the layer: `finish` copies every layer again.

    def finish(self, metadata: KVCRConnectorMetadata) -> None:
        """Copies what no `save_layer` did, records the step's job and fences."""
        if not metadata.saves:
            return
        step = self.begin(metadata)
        self._resolve(step)
        again = any(n > 1 for n in step.layers.values())
        for group, layers in enumerate(self.layers):
            planes = [plane for name, layer in layers.items()
                      if again or name not in step.layers for plane in layer]
            if planes:
                self._copy(step, group, planes)
        self._step = None
        if step.live():
            step.job = self.engine.record()
            self.engine.fence()
            self._pending.append(step)

    def poll(self) -> None:
        """Seals the saves of every step whose copies completed, oldest first, and counts
        those the sealer committed."""
        self._count_sealed()
        while self._pending:
            step = self._pending[0]
            assert step.job is not None
            try:
                if not step.job.done():
                    return
            except CopyFailed as exc:
                for save in step.live():
                    self._fail(save, exc)
            else:
                for save in step.live():
                    self._seal(save)
            self._pending.popleft()

    def drain(self, timeout_s: float = 5.0) -> None:
        """Waits for every save copied so far and commits it (hashes included, within
        `timeout_s`); aborts an unfinished step."""
        if self._step is not None:
            for save in self._step.saves:
                self._fail(save, RuntimeError("the worker shut down mid-step"), count=False)
            self._step = None
        for step in self._pending:
            assert step.job is not None
            with contextlib.suppress(CopyFailed):
                step.job.wait()  # a failure is handled by the poll
        self.poll()
        self.sealer.flush(timeout_s)
        self._count_sealed()

    def take_report(self) -> tuple[list[bytes], bool]:
        """The keys committed since the last call, and whether the attachment changed since
        (then what was reported before may be gone with the old one)."""
        self._count_sealed()
        saved, self._saved = self._saved, []
        attach = self.client.attach_count
        suspect = self._reported_attach not in (-1, attach)
        self._reported_attach = attach
        return saved, suspect

    # -- pieces --------------------------------------------------------------------------------

    def _resolve(self, step: _Step) -> None:
        """The reservations' replies: the blocks each save was granted slots for."""
        if step.resolved:
            return
        step.resolved = True
        for save in step.saves:
            if save.reservation is None or save.failed:
                continue
            try:
                res = save.reservation.result()
            except Exception as exc:
                self._fail(save, exc)
                continue
            save.op = res.op
            if res.refused:
                self.stats.failure("save_refused", res.refused)
            keys = save.plan.keys_by_rank[self.tp_rank]
            granted = [(b, s, k) for b, s, k in zip(save.plan.block_ids, res.slots, keys,
                                                     strict=True) if s is not None]
            if granted:
                save.blocks, save.slots, save.keys = (tuple(x) for x in zip(*granted,
                                                                             strict=True))

    def _copy(self, step: _Step, group: int, planes: list[Plane]) -> None:
        """Issues one engine call for every live save of the step's KV cache `group` (one wait
        on vLLM's stream per layer, not per request); a save that cannot be planned fails
        alone."""
        live = [save for save in step.live() if save.plan.group == group]
        if not live:
            return
        try:
            with self.binding.use(group) as rows:
                calls: list[BlockCopy] = []
                for save in live:
                    try:
                        if save.attach != self.client.attach_count:
                            raise RunnerUnavailable("reattached", "its slots are gone")
                        calls.append(BlockCopy(planes, rows, save.blocks, save.slots, True))
                    except (RunnerError, ValueError) as exc:
                        self._fail(save, exc)
                copy_calls(self.engine, calls)
        except Exception as exc:
            for save in live:
                self._fail(save, exc)

    def _seal(self, save: _Save) -> None:
        """Hands the save's blocks (every layer copied: they are whole) to the sealer."""
        try:
            if save.attach != self.client.attach_count:
                raise RunnerUnavailable("reattached", "its slots are gone")
            view = self.client.pool(save.plan.group).view
            views = [view(SlotId(slot)) for slot in save.slots]
        except Exception as exc:
            self._fail(save, exc)
            return
        self.sealer.seal(views, functools.partial(self._publish, save))

    def _publish(self, save: _Save, checksums: list[int]) -> None:
        """On a sealer thread: the commit, with the checksums just taken."""
        assert save.op is not None
        try:
            self.client.commit_nowait(save.op, checksums=checksums, ns=save.plan.group)
        except Exception as exc:
            self._sealed.append((save, exc))
        else:
            self._sealed.append((save, None))

    def _count_sealed(self) -> None:
        while self._sealed:
            save, exc = self._sealed.popleft()
            if exc is not None:
                self._fail(save, exc)
                continue
            self._saved += save.keys
            self.stats.add("stored_blocks", len(save.blocks))
            self.stats.add("stored_tokens", len(save.blocks) * self.block_tokens)

    def _fail(self, save: _Save, exc: BaseException, *, count: bool = True) -> None:
        """Counts the failure once and aborts the reservation: nothing is published."""
        if save.failed:
            return
        save.failed = True
        if count:
            save_failed(self.stats, save.plan, exc)
        if save.op is not None:
            with contextlib.suppress(RunnerError):
                self.client.abort(save.op, save.plan.group)


def save_failed(stats: StatsRecorder, plan: SavePlan, exc: BaseException) -> None:
    if isinstance(exc, RunnerError):
        stats.failure("guard_unavailable")
    else:
        log.error("kvcr save of %s failed (%s); nothing was published", plan.req_id, exc)
        stats.failure("save_copy")
