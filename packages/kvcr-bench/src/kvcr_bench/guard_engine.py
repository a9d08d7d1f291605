"""The legitimate engine of `kvcr bench guard --under-attack` (kvcr_bench.guard_attack): it
does what a vLLM scheduler and its worker do every step, timing each round trip to
kvcr-guard, and checks what it loads.

Each step is one request: a lookup of its 64 keys; every tenth (from the 10th) a reserve +
commit of 8 fresh blocks; every tenth (from the 5th) a load: a lease on its 64 keys, whose
blocks it reads back, checked as an engine with the default `verify_loads` (auto: in a
namespace other uids map too) checks them (a block that fails is recomputed; one that reads
as zeros and is used anyway is counted: the pool's pages were punched out under it), then
released, and what the Runner dropped stored again, untimed (an engine recomputes it).
`first_path`: a socket it is pointed at first (it must refuse it before saying anything);
then it goes to the real one. `poison_peer`: every tenth step (from the 3rd) it asks its
Runner to fetch blocks it misses from that peer (a hint named it), polls until the fetch
ends, and counts what its Runner accepted and whether it now holds the peer's bytes. A step
the Runner fails (RunnerError: the engine would recompute) is counted, not timed.

Threading: one thread, one connection, like a scheduler.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from kvcr_bench.attacker import BLOCK, POISON_BLOCKS, POISON_BYTE, POISON_SEED, SPEC
from kvcr_core.attach import AttachClient, RunnerError
from kvcr_core.attach import protocol as p
from kvcr_core.checksums import block_checksum
from kvcr_core.config import KVCRConfig, verifies_loads
from kvcr_core.index import Lease
from kvcr_core.peers import FetchStatus
from kvcr_core.testing import pattern_block, random_keys

_ZERO_BLOCK = bytes(BLOCK)


@dataclasses.dataclass
class EngineRun:
    """What the engine saw in one case."""

    samples_s: list[float] = dataclasses.field(default_factory=list)
    asked_blocks: int = 0  # reserved for a store
    stored_blocks: int = 0  # granted and committed
    loaded_blocks: int = 0
    zero_blocks: int = 0  # loaded, read back as zeros and used: never acceptable
    rejected_blocks: int = 0  # loaded, failed the engine's check: recomputed
    peer_accepted: int = 0  # blocks its Runner fetched from `poison_peer` as OK
    peer_refused: int = 0  # ... refused as UNTRUSTED
    poisoned_blocks: int = 0  # the poisoning peer's bytes it then held: never acceptable
    failed_steps: int = 0  # steps that raised RunnerError (the engine fell back)
    intact: bool | None = True  # its blocks matched their checksums at the end (None: no
    # answer to check with)
    refused: str = ""  # the reason it refused `first_path` ("": not pointed at one)
    refuse_ms: float = 0.0


class BenchEngine:
    def __init__(self, path: str, seed: int, first_path: str | None = None, *,
                 tenant: str = "", poison_peer: str | None = None) -> None:
        self.path, self.seed, self.poison_peer = path, seed, poison_peer
        self.client = AttachClient(first_path or path, dataclasses.replace(SPEC, tenant=tenant),
                                   BLOCK, identity="legit engine")
        self.verify_setting = KVCRConfig().verify_loads
        self.keys = random_keys(64, seed=seed)
        self.blocks = {k: pattern_block(k, BLOCK) for k in self.keys}
        self.run = EngineRun()
        if first_path is not None:
            self._refuse_first()
        self._step(self.client.store, self.keys, [self.blocks[k] for k in self.keys])

    def _refuse_first(self) -> None:
        start = time.perf_counter()
        try:
            self.client.lookup(self.keys[:1])
            self.run.refused = "not refused"
        except RunnerError as exc:
            self.run.refused = exc.reason
        self.run.refuse_ms = (time.perf_counter() - start) * 1000
        self.client.retarget(self.path)

    def steps(self, seconds: float) -> EngineRun:
        lookup = [p.Lookup(list(self.keys))]
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            i += 1
            if i % 10 == 0:
                self._step(self._store_fresh, i)
            elif i % 10 == 5:
                self._step(self._load)
            elif i % 10 == 3 and self.poison_peer is not None:
                self._step(self._fetch_poison, self.poison_peer)
            else:
                self._step(self._lookup, lookup)
        self.run.intact = None
        self._step(self._check_intact)
        self.client.close()
        return self.run

    def _step(self, work: Callable[..., object], *args: Any) -> None:
        try:
            work(*args)
        except RunnerError:
            self.run.failed_steps += 1
            time.sleep(0.001)  # the client backs off; so does its engine's scheduler

    def _lookup(self, lookup: list[p.Op]) -> None:
        start = time.perf_counter()
        self.client.batch(lookup)
        self.run.samples_s.append(time.perf_counter() - start)

    def _store_fresh(self, i: int) -> None:
        fresh = random_keys(8, seed=self.seed * 100_000 + i)
        start = time.perf_counter()
        res = self.client.reserve(fresh)
        view = self.client.pool().view
        sums = []
        for key, slot in zip(fresh, res.slots, strict=True):
            if slot is not None:
                view(slot)[:] = pattern_block(key, BLOCK)
                sums.append(block_checksum(view(slot)))
        self.client.commit(res.op, checksums=sums)
        self.run.samples_s.append(time.perf_counter() - start)
        self.run.asked_blocks += len(fresh)
        self.run.stored_blocks += res.granted

    def _timed(self, work: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = work()
        self.run.samples_s.append(time.perf_counter() - start)
        return out

    def _fetch_poison(self, peer: str) -> None:
        keys = random_keys(POISON_BLOCKS, seed=POISON_SEED)
        client = self.client
        ticket = self._timed(lambda: client.peer_fetch(peer, [keys], 2.0))
        deadline = time.monotonic() + 3.0
        while not (outcome := self._timed(lambda: client.peer_poll(ticket))).done:
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)
        statuses = outcome.statuses[0]
        self.run.peer_accepted += sum(s == FetchStatus.OK for s in statuses)
        self.run.peer_refused += sum(s == FetchStatus.UNTRUSTED for s in statuses)
        lease = client.acquire(keys, prefix_only=False)
        view = client.pool().view
        poison = bytes([POISON_BYTE]) * BLOCK
        self.run.poisoned_blocks += sum(1 for s in lease.slots
                                        if s is not None and bytes(view(s)) == poison)
        client.release(lease.op)

    def _load(self) -> None:
        verify = verifies_loads(self.verify_setting, self.client.shared)
        lease = self._timed(lambda: self.client.acquire(self.keys, prefix_only=False,
                                                        checksums=verify))
        self._read(lease, verify)
        self.client.release(lease.op)
        dropped = [k for k, s in zip(self.keys, lease.slots, strict=True) if s is None]
        if dropped:  # evicted, or dropped as corrupt: recomputed and stored again
            self.client.store(dropped, [self.blocks[k] for k in dropped])

    def _read(self, lease: Lease, verify: bool) -> None:
        view = self.client.pool().view
        held = [s for s in lease.slots if s is not None]  # lease.checksums are of these
        for i, slot in enumerate(held):
            data = bytes(view(slot))
            self.run.loaded_blocks += 1
            if verify and block_checksum(data) != lease.checksums[i]:
                self.run.rejected_blocks += 1  # the engine recomputes it
            else:
                self.run.zero_blocks += data == _ZERO_BLOCK

    def _check_intact(self) -> None:
        """Whether its blocks still match their committed checksums (a scribbler may have hit
        them: then a verified load refuses them)."""
        lease = self.client.acquire(self.keys, prefix_only=False, checksums=True)
        view = self.client.pool().view
        held = [s for s in lease.slots if s is not None]  # the rest were evicted or dropped
        intact = all(block_checksum(view(s)) == c
                     for s, c in zip(held, lease.checksums, strict=True))
        self.client.release(lease.op)
        self.run.intact = intact


def engine_round_trips(path: str, seconds: float, seed: int, first_path: str | None = None,
                       *, tenant: str = "", poison_peer: str | None = None) -> EngineRun:
    return BenchEngine(path, seed, first_path, tenant=tenant,
                       poison_peer=poison_peer).steps(seconds)

