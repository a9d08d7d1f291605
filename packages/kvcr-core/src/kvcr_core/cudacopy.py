"""`CudaCopyEngine`: the copy engine for KV tensors on a CUDA device (the CUDA half of
kvcr-core's torch seam; `copyengine.engine_for` imports it for a CUDA device only).

- Pinning: each process registers its mapping of the pool with CUDA once per attach
  (`cudaHostRegister` through torch's cudart bindings), so copies run as DMA at link speed,
  and unregisters it, after waiting for its stream, before the mapping may go. Registering
  faults in and locks every page of the mapping: seconds for a large pool, logged. A registration
  that fails leaves pageable copies (correct, slower): counted in `pin_failures`, logged once.
- Copies run on the engine's own stream, ordered after the caller's current stream (the
  forward that wrote the KV being saved, or that last read the blocks a load overwrites). A
  pair contiguous on both sides is one `copy_(non_blocking=True)` (cudaMemcpyAsync). A run of
  a plane (rows of one page at the pool's slot stride) is one `cudaMemcpy2DAsync` when torch's
  libcudart is a loaded shared library, else one `copy_` per row: torch would stage a strided
  copy between host and device through pageable memory.
- `record` puts an event on the stream: `done` is its `query()` (never blocks), `wait` its
  `synchronize()`. `fence` makes the caller's current stream wait for the engine's stream on
  the device; the host does not block.

Threading: several threads may issue copies (CUDA streams are thread-safe); the counters are
updated under the GIL. Not yet run on hardware when written: docs/gpu.md says what has.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvcr_core.copyengine import CopyFailed, CopyJob
from kvcr_core.memory import HostRegion

log = logging.getLogger("kvcr_core.copies")
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the addresses (UVA)
Memcpy2D = Callable[[int, int, int, int, int, int, int, int], int]


def find_memcpy2d() -> Memcpy2D | None:
    """`cudaMemcpy2DAsync` of the libcudart torch loaded (None if torch links it statically
    or it cannot be found: then rows are copied one by one)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {parts[5] for line in maps.splitlines()
             if len(parts := line.split(maxsplit=5)) == 6 and "libcudart.so" in parts[5]}
    for path in sorted(paths):
        try:
            function = ctypes.CDLL(path).cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                             ctypes.c_void_p]
        found: Memcpy2D = function
        return found
    return None


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


class CudaCopyEngine:
    asynchronous = True

    def __init__(self, device: torch.device | str, *, use_memcpy2d: bool = True) -> None:
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self._pinned: set[int] = set()
        self.pin_failures = 0
        self.memcpy2d = find_memcpy2d() if use_memcpy2d else None

    # -- the pool mapping ------------------------------------------------------------------

    def pin_pool(self, region: HostRegion) -> torch.Tensor:
        flat = torch.frombuffer(region.view, dtype=torch.uint8)
        address, size = flat.data_ptr(), flat.numel()
        start = time.perf_counter()
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        error = int(cudart.cudaHostRegister(address, size, _REGISTER_PORTABLE))
        if error == 0:  # every page faulted in and locked: seconds for a large pool
            self._pinned.add(address)
            log.info("kvcr: pinned the pool mapping for CUDA (%d MiB) in %.2f s",
                     size >> 20, time.perf_counter() - start)
            return flat
        self.pin_failures += 1
        if self.pin_failures == 1:
            log.warning("kvcr: could not pin the pool mapping for CUDA (cudaHostRegister of "
                        "%d bytes: cudaError %d); copies stay pageable, slower (counted as "
                        "pin_failed)", size, error)
        return flat

    def unpin_pool(self, pool: torch.Tensor) -> None:
        address = pool.data_ptr()
        try:
            self._stream.synchronize()
        finally:  # even after a CUDA error: never leave a registration behind an unmap
            if address in self._pinned:
                self._pinned.discard(address)
                cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
                error = int(cudart.cudaHostUnregister(address))
                if error != 0:
                    log.warning("kvcr: cudaHostUnregister failed (cudaError %d)", error)

    # -- copies ----------------------------------------------------------------------------

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pairs:
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for dst, src in pairs:
                self._issue(dst, src)

    def _issue(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise CopyFailed(f"cannot copy {src.dtype}{tuple(src.shape)} into "
                             f"{dst.dtype}{tuple(dst.shape)}")
        if dst.is_contiguous() and src.is_contiguous():
            dst.copy_(src, non_blocking=True)
        elif _rows(dst) and _rows(src) and self.memcpy2d is not None:
            size = dst.element_size()
            error = self.memcpy2d(dst.data_ptr(), dst.stride(0) * size, src.data_ptr(),
                                  src.stride(0) * size, dst.shape[1] * size, dst.shape[0],
                                  _MEMCPY_DEFAULT, self._stream.cuda_stream)
            if error != 0:
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
