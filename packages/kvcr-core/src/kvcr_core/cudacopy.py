"""`CudaCopyEngine`: the copy engine for KV tensors on a CUDA device (the CUDA half of
kvcr-core's torch seam; `copyengine.engine_for` imports it for a CUDA device only).

- Pinning: each process registers its mapping of the pool with CUDA once per attach
  (`cudaHostRegister`, portable and mapped), so copies run as DMA at link speed, and
  unregisters it, after waiting for its stream, before the mapping may go. Registering faults
  in and locks every page of the mapping: seconds for a large pool, logged. A registration
  that fails leaves pageable copies (correct, slower): counted in `pin_failures`. Every direct
  runtime call goes through `kvcr_core.cudart.CudaRuntime`, which clears the error a failed
  call leaves pending (else the next torch kernel of the process raises it), logs once and
  counts (`cuda_failures`).
- Copies run on the engine's own stream, ordered after the caller's current stream (the
  forward that wrote the KV being saved, or that last read the blocks a load overwrites).
  A `block_pairs` call (or several sharing planes and pool rows) is one `Gather`; `strategy`
  picks how it goes (`strategy_counts` counts each choice):
  - `runs`: one copy per run and plane: a pair contiguous on both sides is one
    `copy_(non_blocking=True)` (cudaMemcpyAsync), a strided run (rows of a page at the pool's
    slot stride) one `cudaMemcpy2DAsync`, else one `copy_` per row (torch would stage a strided
    host <-> device copy through pageable memory);
  - `gather`: the pages of as many blocks as half of `staging_bytes` holds gathered on the
    device (one `index_select` per plane) into a staging buffer laid out as their slots, then
    one DMA per run of consecutive slots; loads the reverse (DMA, then one `index_copy_` per
    plane). Many small copies become few large ones: per-layer planes of 32 KiB (vLLM) in
    scattered blocks. The device side runs on a second stream, so one half's gather overlaps
    the other half's DMA (events order each half's uses);
  - `direct`: the same staging, but the pool side is one kernel over the registered pool
    mapping itself (zero-copy), whatever the slots;
  - `auto` (default): `runs` where its copies are large or gathering saves none, else
    `gather` (thresholds from the H200 measurements in docs/gpu.md).
- `record` puts an event on the stream: `done` is its `query()` (never blocks), `wait` its
  `synchronize()`. `fence` makes the caller's current stream wait for the engine's stream on
  the device; the host does not block.

Threading: several threads may issue copies (CUDA streams are thread-safe); gathers share the
staging buffer and are issued under a lock; counters are updated under the GIL.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kvcr_core.copyengine import BlockCopy, CopyFailed, CopyJob, Gather, batch_copies, gathers
from kvcr_core.cudart import CudaRuntime, PoolPins, load_libcudart
from kvcr_core.memory import HostRegion

if TYPE_CHECKING:
    from kvcr_core.copyengine import Pair

log = logging.getLogger("kvcr_core.copies")
STRATEGIES = ("auto", "runs", "gather", "direct")
GATHER_BELOW_BYTES = 2 << 20  # auto gathers where the runs' copies average less than this
STAGING_BYTES = 64 << 20  # device memory for gathers, taken at the first one
Dma = Callable[[torch.Tensor, torch.Tensor], None]


class TorchCudart:
    """`RuntimeCalls` through torch's bindings (torch links libcudart statically): no
    `cudaGetLastError` (the runtime's caller clears by a checked launch), no strided copy."""

    has_memcpy2d = False

    def __init__(self) -> None:
        self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]

    def host_register(self, address: int, size: int, flags: int) -> int:
        return int(self._cudart.cudaHostRegister(address, size, flags))

    def host_unregister(self, address: int) -> int:
        return int(self._cudart.cudaHostUnregister(address))

    def host_device_pointer(self, address: int) -> tuple[int, int]:
        return 0, 0  # unknown: no zero-copy

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                       height: int, kind: int, stream: int) -> int:
        raise NotImplementedError

    def get_last_error(self) -> int:
        raise NotImplementedError


def cuda_runtime(device: torch.device) -> CudaRuntime:
    """Checked runtime calls through the libcudart torch loaded, else torch's bindings."""
    lib = load_libcudart(torch.version.cuda)
    if lib is not None:
        return CudaRuntime(lib)

    def clear() -> None:  # a launch's check (cudaGetLastError) raises and clears it
        with contextlib.suppress(RuntimeError):
            torch.empty(1, device=device).fill_(0)

    return CudaRuntime(TorchCudart(), clear)


class EventJob:
    """Copies issued before an event on the engine's stream."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        try:
            return bool(self.event.query())  # type: ignore[no-untyped-call]
        except RuntimeError as exc:  # a CUDA error surfaced by the poll
            raise CopyFailed(f"CUDA copy failed: {exc}") from exc

    def wait(self) -> None:
        try:
            self.event.synchronize()
        except RuntimeError as exc:
            raise CopyFailed(f"CUDA copy failed: {exc}") from exc


def _rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1


def _aligned(t: torch.Tensor, words: int = 8) -> bool:
    return t.data_ptr() % words == 0 and t.stride(0) % words == 0 and t.shape[1] % words == 0


class Stages(Protocol):
    """Where a chunk's two sides run: the device side (gathers, scatters) and the pool side
    (DMAs or the zero-copy kernel), each ordered after what last used its buffer."""

    def device_side(self, chunk: int) -> contextlib.AbstractContextManager[None]: ...

    def pool_side(self, chunk: int) -> contextlib.AbstractContextManager[None]: ...


class InOrder:
    """Both sides in issue order (one stream, or CPU)."""

    def device_side(self, chunk: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def pool_side(self, chunk: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def gather_copy(g: Gather, buffers: Sequence[torch.Tensor], blocks: torch.Tensor,
                slots: torch.Tensor, dma: Dma, pool: torch.Tensor | None = None,
                stages: Stages | None = None) -> None:
    """Carries out `g` through `buffers` (uint8 on the planes' device, used in turn), as many
    blocks at a time as one holds. `blocks` and `slots` are `g`'s ids as int64 tensors on that
    device; `pool` is `g.rows` as a device tensor (zero-copy), else the pool side goes by
    `dma` (destination, source), one call per run of consecutive slots. Device-neutral: CPU
    tests run it on CPU tensors."""
    stages = stages or InOrder()
    chunk = min(b.numel() for b in buffers) // g.span
    cols = slice(g.offset, g.offset + g.span)
    words = all(_aligned(p) and o % 8 == 0 for p, o, _ in g.planes) and g.offset % 8 == 0 \
        and _aligned(g.rows) and (pool is None or _aligned(pool)) \
        and all(b.data_ptr() % 8 == 0 for b in buffers)

    def w(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int64) if words else t

    for c, start in enumerate(range(0, len(g.slots), chunk)):
        stop = min(start + chunk, len(g.slots))
        stage = buffers[c % len(buffers)][:(stop - start) * g.span].view(stop - start, g.span)
        index = blocks[start:stop]
        parts = [(w(plane), w(stage[:, offset - g.offset:offset - g.offset + page]))
                 for plane, offset, page in g.planes]
        if g.into_pool:
            with stages.device_side(c):
                for plane, part in parts:
                    torch.index_select(plane, 0, index, out=part)
        with stages.pool_side(c):
            if pool is not None and g.into_pool:
                w(pool[:, cols]).index_copy_(0, slots[start:stop], w(stage))
            elif pool is not None:
                torch.index_select(w(pool[:, cols]), 0, slots[start:stop], out=w(stage))
            for i, slot, n in ([] if pool is not None else g.slot_runs(start, stop)):
                here, there = stage[i - start:i - start + n], g.rows[slot:slot + n, cols]
                if g.into_pool:
                    dma(there, here)
                else:
                    dma(here, there)
        if not g.into_pool:
            with stages.device_side(c):
                for plane, part in parts:
                    plane.index_copy_(0, index, part)


class TwoStreams:
    """The device side on a stream of its own, the pool side on the engine's: a chunk's
    gather overlaps the previous chunk's DMA. Events order each side after the other side's
    last use of the same buffer."""

    def __init__(self, main: torch.cuda.Stream, side: torch.cuda.Stream, buffers: int) -> None:
        self.main, self.side = main, side
        self.device_done: list[torch.cuda.Event | None] = [None] * buffers
        self.pool_done: list[torch.cuda.Event | None] = [None] * buffers

    @contextlib.contextmanager
    def device_side(self, chunk: int) -> Iterator[None]:
        with self._on(self.side, self.pool_done, self.device_done, chunk):
            yield

    @contextlib.contextmanager
    def pool_side(self, chunk: int) -> Iterator[None]:
        with self._on(self.main, self.device_done, self.pool_done, chunk):
            yield

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream, after: list[torch.cuda.Event | None],
            done: list[torch.cuda.Event | None], chunk: int) -> Iterator[None]:
        b = chunk % len(done)
        with torch.cuda.stream(stream):
            if (event := after[b]) is not None:
                stream.wait_event(event)
            yield
            done[b] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done[b].record(stream)  # type: ignore[union-attr]


def choose(g: Gather, strategy: str) -> str:
    """`strategy`, or for `auto`: `runs` where gathering saves no copy or the runs' copies
    are large, else `gather`."""
    if strategy != "auto":
        return strategy
    dmas = sum(1 for _ in g.slot_runs(0, len(g.slots)))
    copies = g.copies
    if dmas >= copies or len(g.slots) * g.span >= copies * GATHER_BELOW_BYTES:
        return "runs"
    return "gather"


class _DeviceArray:
    """A device address as a CUDA array (`torch.as_tensor` wraps it without copying)."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1",
                                         "data": (address, False), "version": 2}


class CudaCopyEngine:
    asynchronous = True

    def __init__(self, device: torch.device | str, *, use_memcpy2d: bool = True,
                 strategy: str = "auto", staging_bytes: int = STAGING_BYTES) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self._side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.runtime = cuda_runtime(self.device)
        self._pins = PoolPins(self.runtime)
        self.memcpy2d = use_memcpy2d and self.runtime.has_memcpy2d
        self.strategy = strategy
        self.strategy_counts = dict.fromkeys(STRATEGIES[1:], 0)
        self.staging_bytes = staging_bytes
        self._staging: torch.Tensor | None = None
        self._lock = threading.Lock()

    @property
    def pin_failures(self) -> int:
        return self._pins.pin_failures

    @property
    def cuda_failures(self) -> int:
        """Failed runtime calls (each cleared, logged once per call name)."""
        return self.runtime.failures_total

    # -- the pool mapping ------------------------------------------------------------------

    def pin_pool(self, region: HostRegion) -> torch.Tensor:
        flat = torch.frombuffer(region.view, dtype=torch.uint8)
        self._pins.pin(flat.data_ptr(), flat.numel())
        return flat

    def unpin_pool(self, pool: torch.Tensor) -> None:
        try:
            self._stream.synchronize()
        finally:  # even after a CUDA error: never leave a registration behind an unmap
            self._pins.unpin(pool.data_ptr())

    # -- copies ----------------------------------------------------------------------------

    def copy(self, pairs: Sequence[Pair]) -> None:
        if not pairs:
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for item in batch_copies(pairs):
                if isinstance(item, Gather):
                    self._gather(item)
                else:
                    self._issue(*item)

    def copy_blocks(self, calls: Sequence[BlockCopy]) -> None:
        """`copy` of the calls' pairs, planned only where a call goes run by run."""
        if not calls:
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for item in gathers(calls):
                if isinstance(item, Gather):
                    self._gather(item)
                elif isinstance(item, BlockCopy):
                    for dst, src in item.pairs():
                        self._issue(dst, src)

    def _gather(self, g: Gather) -> None:
        how = choose(g, self.strategy)
        pool = self._pool_on_device(g.rows) if how == "direct" else None
        if how == "direct" and pool is None:
            how = "gather"  # the mapping is not pinned and mapped: DMA it is
        with self._lock:
            buffers = self._buffers_for(g.span) if how != "runs" else []
            how = how if buffers else "runs"
            self.strategy_counts[how] += 1
            if not buffers:
                for dst, src in g.pairs():
                    self._issue(dst, src)
                return
            ids = torch.tensor(g.block_ids + g.slots, dtype=torch.int64, pin_memory=True)
            ids = ids.to(self.device, non_blocking=True)
            ids.record_stream(self._side)
            self._side.wait_stream(self._stream)  # the ids, the caller's work, earlier DMAs
            k = len(g.slots)
            gather_copy(g, buffers, ids[:k], ids[k:], self._issue, pool,
                        TwoStreams(self._stream, self._side, len(buffers)))
            self._stream.wait_stream(self._side)  # record() and fence() cover the gathers

    def _buffers_for(self, span: int) -> list[torch.Tensor]:
        """The two halves of the staging buffer (taken at the first gather), or none if a
        half cannot hold one block."""
        if self._staging is None and self.staging_bytes >= 2 * span:
            try:
                self._staging = torch.empty(self.staging_bytes, dtype=torch.uint8,
                                            device=self.device)
            except torch.OutOfMemoryError:
                log.warning("kvcr: no %d MiB of device memory for gathered copies; copying "
                            "run by run instead", self.staging_bytes >> 20)
                self.staging_bytes = 0
        half = self._staging.numel() // 2 // 512 * 512 if self._staging is not None else 0
        if self._staging is None or half < span:
            return []
        return [self._staging[:half], self._staging[half:2 * half]]

    def _pool_on_device(self, rows: torch.Tensor) -> torch.Tensor | None:
        """`rows` as a CUDA tensor over the registered mapping (zero-copy), if pinned."""
        size = (rows.shape[0] - 1) * rows.stride(0) + rows.shape[1]
        address = self._pins.device_address(rows.data_ptr(), size)
        if address is None:
            return None
        flat = torch.as_tensor(_DeviceArray(address, size))
        return flat.as_strided(tuple(rows.shape), tuple(rows.stride()))

    def _issue(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise CopyFailed(f"cannot copy {src.dtype}{tuple(src.shape)} into "
                             f"{dst.dtype}{tuple(dst.shape)}")
        if dst.is_contiguous() and src.is_contiguous():
            dst.copy_(src, non_blocking=True)
        elif _rows(dst) and _rows(src) and self.memcpy2d:
            size = dst.element_size()
            error = self.runtime.memcpy2d_async(
                dst.data_ptr(), dst.stride(0) * size, src.data_ptr(), src.stride(0) * size,
                dst.shape[1] * size, dst.shape[0], self._stream.cuda_stream)
            if error != 0:  # cleared and counted by the runtime
                raise CopyFailed(f"cudaMemcpy2DAsync failed (cudaError {error})")
        elif _rows(dst) and _rows(src):
            for d, s in zip(dst, src, strict=True):
                d.copy_(s, non_blocking=True)
        else:  # no planner of kvcr makes these: correct, synchronous
            dst.copy_(src)

    def record(self) -> CopyJob:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return EventJob(event)

    def fence(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def drain(self) -> None:
        """Blocks until every copy issued so far completed."""
        self._stream.synchronize()
