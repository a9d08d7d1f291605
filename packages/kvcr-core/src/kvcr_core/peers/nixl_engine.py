"""The NIXL seam: the only module that imports nixl, and only when a peer asks for it.

`NixlEngine.shared()` is the process's one NIXL agent (UCX backend, DRAM only), shared by every
`NixlTransport` (kvcr_core.peers.reads) of the process: the `PeerServer`'s and every
`PeerClient`'s. It is started once, in the background
(`start()`: importing nixl and creating the agent take about a second and hold the GIL for
part of it); until it is ready, peers use TCP. Pool regions are registered once each
(reference-counted); remote agents are loaded from metadata received on an authenticated
peer connection (never from the network on their own) and dropped with their last
connection. Transfers are destination-initiated READs from a source's leased slots into
locally reserved slots.

Threading: NIXL's own progress thread is OFF (measured on 2 cores: it burns a core and halves
throughput), and so is its listener thread; nothing here starts a thread except
the one-shot starter and the read lanes (idle, blocked, between fetches). Callers drive
progress: a reader polls its transfer; a source calls `progress()` while a peer may be
connecting or reading. The agent runs in NIXL_THREAD_SYNC_RW mode with `lanes` UCX workers
(thread-safe ones): transfers from several threads run at once, each on the worker UCX bound to
the thread that made the READ (a thread's first READ takes the next worker in turn), while
registrations and peers change under NIXL's exclusive lock; this module's own lock guards its
tables and every call except posting and polling a READ. `read_lanes` are one thread per
worker, each bound to its own at start (before anyone else can make a READ), that READ and hash
fetches' chunks (kvcr_core.peers.lanes). On one host UCX copies with cma: one kernel copy
inside `transfer()` (which releases the GIL), so a READ is done when `NixlRead.start` (or
`post_read`) returns, and READs of two lanes copy on two cores; over UCX's TCP transport or
RDMA a READ moves while its thread polls. A fetch's READs are made with prepared descriptor
lists (`slot_list` once per local pool, `prepare_reads` once per fetch for the source's
addresses), which makes each READ a few us of work instead of tens.

Flavours: nixl ships per-CUDA wheels (nixl_cu12, nixl_cu13) behind the `nixl` meta package,
which imports torch to choose on CPU-only hosts (seconds). A flavour already imported in this
process wins (two cannot share a process); with a CUDA torch build the meta package picks;
otherwise the first installed flavour in the meta package's own order is imported directly.
UCX reads its UCX_* environment variables at agent creation (e.g. `UCX_TLS=tcp` to force the
network path between namespaces of one host; see docs/peers.md).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.util
import logging
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from kvcr_core.memory import HostRegion, RegionKind
from kvcr_core.peers.lanes import ReadLanes
from kvcr_core.peers.transport import ReadRefused, TransportError

log = logging.getLogger("kvcr_core.peers")
_FLAVOURS = ("nixl_cu13", "nixl_cu12")  # the meta package's own order when no CUDA is found
_POLL_MAX_S = 0.0001  # UCX over TCP moves data only while the reader polls
_LANES = 2  # read lanes (and UCX workers) by default: see kvcr_core.peers.lanes


class NixlError(TransportError):
    """NIXL could not start, register memory, or complete a transfer (the peer falls back to
    TCP, or the blocks of the failed transfer are dropped unpublished)."""


class NixlRequestRefused(NixlError, ReadRefused):
    """NIXL refused a read before moving anything: the source named addresses outside what it
    registered (the source's fault), or its agent is not loaded here."""


def nixl_installed() -> bool:
    """Whether a NIXL wheel is importable here (checked without importing it)."""
    return any(importlib.util.find_spec(name) is not None for name in (*_FLAVOURS, "nixl"))


def _torch_cuda_build() -> bool:
    """Whether the installed torch is a CUDA build, read from its version.py (no import)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    version = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = version.read_text()
    except OSError:
        return False
    return re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]\d", text, re.MULTILINE) is not None


def _load_api() -> Any:
    for name in ("nixl._api", *(f"{flavour}._api" for flavour in _FLAVOURS)):
        if name in sys.modules:
            return sys.modules[name]
    if "torch" in sys.modules or _torch_cuda_build():
        return importlib.import_module("nixl._api")
    for flavour in _FLAVOURS:
        if importlib.util.find_spec(flavour) is not None:
            return importlib.import_module(f"{flavour}._api")
    return importlib.import_module("nixl._api")


def _quiet_nixl_logger() -> None:
    """nixl logs INFO to stdout; stdout belongs to the application (e.g. `--json`)."""
    nixl_log = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)
    for handler in nixl_log.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


class EngineState(enum.Enum):
    IDLE = "idle"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"


class NixlEngine:
    """One NIXL agent for the process; see the module docstring."""

    _shared: ClassVar[NixlEngine | None] = None
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, lanes: int | None = None) -> None:
        if lanes is None:  # two copies at once where there are two CPUs to run them
            lanes = min(_LANES, len(os.sched_getaffinity(0)))
        if lanes < 1:
            raise ValueError("a NIXL engine needs at least one lane")
        self.name = f"kvcr-{os.getpid()}-{secrets.token_hex(4)}"
        self.lanes = lanes  # UCX workers, and the threads that READ fetches (read_lanes)
        self.read_lanes = ReadLanes(0)  # bound lane threads once started
        self.state = EngineState.IDLE
        self.failure = ""
        self._agent: Any = None
        self._lock = threading.Lock()  # every call into the agent
        self._ready = threading.Event()
        # (address, bytes) -> (users, registration, the metadata a peer needs to read it)
        self._regions: dict[tuple[int, int], tuple[int, Any, bytes]] = {}
        self._peers: dict[str, int] = {}  # remote agent name -> connections using it
        # (address, stride, bytes, count) -> a registered region's slots, prepared (slot_list)
        self._slot_lists: dict[tuple[int, int, int, int], Any] = {}

    @classmethod
    def shared(cls) -> NixlEngine:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = NixlEngine()
            return cls._shared

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, *, wait: bool = False) -> bool:
        """Starts the agent once (in a one-shot thread unless `wait`); returns whether ready.
        Never raises: a failure is logged once and leaves `state` FAILED (peers use TCP)."""
        with self._lock:
            starting = self.state is EngineState.IDLE
            if starting:
                self.state = EngineState.STARTING
        if starting and wait:
            self._start()
        elif starting:
            threading.Thread(target=self._start, name="kvcr-nixl-start", daemon=True).start()
        return self.ready()

    def ready(self) -> bool:
        return self.state is EngineState.READY

    def wait_ready(self, timeout_s: float) -> bool:
        self.start()
        self._ready.wait(timeout_s)
        return self.ready()

    def _start(self) -> None:
        try:
            api = _load_api()
            _quiet_nixl_logger()
            config = api.nixl_agent_config(
                enable_prog_thread=False, enable_listen_thread=False, backends=[],
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
            agent = api.nixl_agent(self.name, config)
            agent.create_backend("UCX", {"num_workers": str(self.lanes)})
            self.read_lanes = self._bound_lanes(agent)
        except Exception as exc:  # ImportError, or any nixl/UCX error: TCP it is
            self.failure = f"{type(exc).__name__}: {exc}"
            self.state = EngineState.FAILED
            log.warning("NIXL unavailable, peers use TCP: %s", self.failure)
        else:
            with self._lock:
                self._agent = agent
                self.state = EngineState.READY
        finally:
            self._ready.set()

    def _bound_lanes(self, agent: Any) -> ReadLanes:
        """Starts one lane thread per UCX worker, each bound to a worker of its own: UCX gives
        a thread the next worker when it first makes a transfer, so each lane makes one (a
        loopback READ within a probe page, never posted) before the next starts, while no
        other thread can reach the agent yet."""
        if self.lanes < 2:
            return ReadLanes(0)  # one worker: whoever fetches READs
        try:
            return self._start_lanes(agent)
        except Exception as exc:  # NIXL works, only not in parallel: each fetch READs alone
            log.warning("NIXL read lanes did not start (%s); fetches READ on one thread", exc)
            return ReadLanes(0)

    def _start_lanes(self, agent: Any) -> ReadLanes:
        with contextlib.ExitStack() as undo:  # the probe goes in every case, in reverse order
            probe = HostRegion.create(4096, RegionKind.ANONYMOUS)
            undo.callback(probe.close)
            registration = agent.register_memory([(probe.address, 4096, 0, "")], "DRAM")
            undo.callback(agent.deregister_memory, registration)
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(probe.address, 64, 0)], "DRAM")
            undo.callback(agent.release_dlist_handle, local)
            remote = agent.prep_xfer_dlist(self.name, [(probe.address + 64, 64, 0)], "DRAM")
            undo.callback(agent.release_dlist_handle, remote)

            def bind() -> None:
                agent.release_xfer_handle(
                    agent.make_prepped_xfer("READ", local, [0], remote, [0]))

            lanes = ReadLanes(self.lanes, bind)
            lanes.start()
            return lanes

    # -- memory and peers ----------------------------------------------------------------------

    def register(self, address: int, nbytes: int) -> bytes:
        """Registers [address, address + nbytes) as DRAM (once; counted per caller). Returns
        the agent metadata a peer needs to read that region (and no other)."""
        with self._lock:
            agent = self._require()
            users, registration, metadata = self._regions.get((address, nbytes), (0, None, b""))
            if registration is None:
                try:
                    registration = agent.register_memory([(address, nbytes, 0, "")], "DRAM")
                    metadata = bytes(agent.get_partial_agent_metadata(registration,
                                                                      inc_conn_info=True))
                except Exception as exc:
                    raise NixlError(f"registering {nbytes} bytes failed: {exc}") from exc
            self._regions[address, nbytes] = (users + 1, registration, metadata)
            return metadata

    def deregister(self, address: int, nbytes: int) -> None:
        """Drops one caller's registration; the region is deregistered with the last one (do
        this before unmapping it)."""
        with self._lock:
            users, registration, metadata = self._regions.get((address, nbytes), (0, None, b""))
            if registration is None:
                return
            if users > 1:
                self._regions[address, nbytes] = (users - 1, registration, metadata)
                return
            del self._regions[address, nbytes]
            for key in [k for k in self._slot_lists if address <= k[0] < address + nbytes]:
                with contextlib.suppress(Exception):
                    self._require().release_dlist_handle(self._slot_lists.pop(key))
            with contextlib.suppress(Exception):
                self._require().deregister_memory(registration)

    def add_peer(self, metadata: bytes) -> str:
        """Loads a source's agent metadata (from its authenticated Ready); returns its name.
        Reading from this very process's agent needs no metadata (loopback)."""
        with self._lock:
            agent = self._require()
            if any(metadata == own for _, _, own in self._regions.values()):
                return self.name
            try:
                name = agent.add_remote_agent(metadata)
            except Exception as exc:
                raise NixlError(f"peer agent metadata refused: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[name] = self._peers.get(name, 0) + 1
            return name

    def drop_peer(self, name: str) -> None:
        """One connection to `name` is gone; the agent is unloaded with the last one."""
        with self._lock:
            users = self._peers.get(name, 0)
            if users > 1:
                self._peers[name] = users - 1
                return
            if self._peers.pop(name, None) is not None and self._agent is not None:
                # the connection's name may be our own (loopback): nothing was loaded then
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)

    def progress(self) -> None:
        """Drives UCX progress (connection set-up, keep-alives) on a source's behalf."""
        if self._agent is None:
            return
        with self._lock, contextlib.suppress(Exception):
            self._agent.get_new_notifs()

    # -- transfers -----------------------------------------------------------------------------

    def read(self, peer: str, local: Sequence[int], remote: Sequence[int], nbytes: int,
             deadline: float) -> None:
        """READs `nbytes` from each `remote[i]` of agent `peer` into `local[i]`, all at once;
        `post_read` then `NixlRead.wait`, with the same errors."""
        request = self.post_read(peer, local, remote, nbytes, deadline)
        try:
            request.wait(deadline)
        finally:
            request.release()

    def post_read(self, peer: str, local: Sequence[int], remote: Sequence[int], nbytes: int,
                  deadline: float) -> NixlRead:
        """Starts a READ of `nbytes` from each `remote[i]` of agent `peer` into `local[i]`:
        `prepare_read`, then `NixlRead.start`, with their errors. The caller must `release()`
        the returned request (which cancels it if unfinished) before reusing the local
        memory."""
        if time.monotonic() >= deadline:
            raise TimeoutError("deadline passed before a NIXL read")
        request = self.prepare_read(peer, local, remote, nbytes)
        request.start(deadline)
        return request

    def prepare_read(self, peer: str, local: Sequence[int], remote: Sequence[int],
                     nbytes: int) -> NixlRead:
        """A READ of `nbytes` from each `remote[i]` of agent `peer` into `local[i]`, made
        ready to `start()` (a reader prepares the READs of a fetch before the first copy, so
        little Python runs between copies). The caller must `release()` it.

        Raises NixlRequestRefused if NIXL refuses the request (addresses outside what the
        source registered, or an unknown agent)."""
        with self._lock:
            agent = self._require()
            try:
                handle = agent.initialize_xfer(
                    "READ", agent.get_xfer_descs([(a, nbytes, 0) for a in local], "DRAM"),
                    agent.get_xfer_descs([(a, nbytes, 0) for a in remote], "DRAM"), peer)
            except Exception as exc:
                raise NixlRequestRefused(f"transfer request refused: {exc}") from exc
        return NixlRead(self, agent, handle, peer)

    def slot_list(self, address: int, stride: int, nbytes: int, count: int) -> Any:
        """Slots `i < count` of a region registered here (`nbytes` at `address + i * stride`)
        as one prepared descriptor list, made once (a strided list: a few us whatever the
        count) and kept until the region is deregistered: `prepare_reads` then names local
        slots by index instead of building their descriptors per READ."""
        key = (address, stride, nbytes, count)
        with self._lock:
            agent = self._require()
            handle = self._slot_lists.get(key)
            if handle is None:
                try:
                    numpy = importlib.import_module("numpy")  # nixl's own dependency
                    handle = agent.prep_xfer_dlist("NIXL_INIT_AGENT", numpy.array(
                        [[address, nbytes, 0, stride, count]], dtype=numpy.uint64), "DRAM")
                except Exception as exc:
                    raise NixlError(f"preparing {count} slots at {address:#x} failed: {exc}"
                                    ) from exc
                self._slot_lists[key] = handle
            return handle

    def prepare_reads(self, peer: str, slots: Any, remote: Sequence[int],
                      nbytes: int) -> NixlReads:
        """The source's side of one fetch's READs, prepared once: `nbytes` at each address of
        `remote` (agent `peer`); `NixlReads.make` then makes each READ from indices into it and
        into `slots` (a `slot_list`), a few us each, in the thread that will run it. The
        caller must `release()` the result.

        Raises NixlRequestRefused as `prepare_read` does."""
        reads = NixlReads(self, peer, slots)
        if not remote:
            return reads  # nothing to read (NIXL refuses an empty list)
        with self._lock:
            agent = self._require()
            try:
                reads.remote = agent.prep_xfer_dlist(
                    peer, [(a, nbytes, 0) for a in remote], "DRAM")
            except Exception as exc:
                raise NixlRequestRefused(f"transfer request refused: {exc}") from exc
        return reads

    def _release(self, agent: Any, handle: Any, peer: str) -> None:
        with self._lock:
            try:
                agent.release_xfer_handle(handle)
                return
            except Exception as exc:
                log.warning("cancelling a NIXL read from %s failed (%s); disconnecting", peer,
                            exc)
            # Still in flight and not cancellable: disconnecting the peer ends the request
            # before the caller frees the slots it was writing into.
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(peer)
            self._peers.pop(peer, None)
            try:
                agent.release_xfer_handle(handle)
            except Exception as exc:
                raise NixlError(f"a NIXL read from {peer} could not be cancelled: {exc}"
                                ) from exc

    def _require(self) -> Any:
        if self._agent is None:
            raise NixlError(f"NIXL is not running ({self.state.value}{': ' if self.failure else ''}"
                            f"{self.failure})")
        return self._agent


class NixlRead:
    """One READ: `start(deadline)` (`post_read` does it), `poll()` (progresses it; True once
    done), `wait(deadline)`, and `release()` (always; cancels it if unfinished). Not shared
    between threads."""

    def __init__(self, engine: NixlEngine, agent: Any, handle: Any, peer: str) -> None:
        self._engine = engine
        self._agent = agent
        self._handle: Any = handle
        self.peer = peer
        self.state = "INIT"

    def start(self, deadline: float) -> None:
        """Posts it. Over cma the bytes move inside this call (which releases the GIL); over
        an asynchronous transport (UCX over TCP, RDMA) they move while the caller does other
        work and polls. Raises TimeoutError if `deadline` has passed, NixlError if posting
        fails (the request is released then)."""
        if time.monotonic() >= deadline:
            raise TimeoutError("deadline passed before a NIXL read")
        try:  # not under the engine's lock: READs of other threads copy meanwhile
            self.state = str(self._agent.transfer(self._handle))
        except Exception as exc:
            self.release()
            raise NixlError(f"posting a transfer failed: {exc}") from exc

    def poll(self) -> bool:
        """Raises NixlError if the transfer failed (the source died). False until started."""
        if self.state == "INIT":
            return False
        if self.state == "PROC" and self._handle is not None:
            self.state = str(self._agent.check_xfer_state(self._handle))
        if self.state not in ("PROC", "DONE"):
            raise NixlError(f"NIXL read from {self.peer} failed")
        return self.state == "DONE"

    def wait(self, deadline: float) -> None:
        """Polls until done; TimeoutError past `deadline`. A READ from this process's own
        agent (loopback) is served by its first UCX worker, which only moves when someone here
        drives it, so waiting drives the whole agent then."""
        pause = 0.0
        loopback = self.peer == self._engine.name
        while not self.poll():
            if time.monotonic() >= deadline:
                raise TimeoutError("deadline passed during a NIXL read")
            if loopback:
                self._engine.progress()
            time.sleep(pause)  # yields the GIL and the core; UCX progresses in check
            pause = min(_POLL_MAX_S, pause * 2 or 2e-5)

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._engine._release(self._agent, handle, self.peer)


class NixlReads:
    """One fetch's READs from one source (`NixlEngine.prepare_reads`): the source's addresses
    prepared once; `make` makes each READ. `release()` releases the prepared addresses (each
    READ is released by whoever ran it)."""

    def __init__(self, engine: NixlEngine, peer: str, slots: Any) -> None:
        self._engine = engine
        self.peer = peer
        self.slots = slots
        self.remote: Any = None

    def make(self, local: Sequence[int], first: int) -> NixlRead:
        """A READ of the prepared addresses `first ..` into the local slots `local` (indices
        into the slot list), ready to `start()`; UCX binds it to the calling thread's worker.
        Raises NixlRequestRefused for a slot the list does not hold or addresses beyond those
        prepared."""
        with self._engine._lock:
            agent = self._engine._require()
            if self.remote is None:
                raise NixlRequestRefused("no prepared addresses to read")
            try:
                handle = agent.make_prepped_xfer("READ", self.slots, list(local), self.remote,
                                                 list(range(first, first + len(local))))
            except Exception as exc:
                raise NixlRequestRefused(f"transfer request refused: {exc}") from exc
        return NixlRead(self._engine, agent, handle, self.peer)

    def release(self) -> None:
        remote, self.remote = self.remote, None
        if remote is not None:
            with self._engine._lock, contextlib.suppress(Exception):
                self._engine._require().release_dlist_handle(remote)
