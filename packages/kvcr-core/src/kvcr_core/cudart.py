"""`CudaRuntime`: every call kvcr makes into the CUDA runtime directly (outside torch's API),
checked one way: registering and unregistering the pool mapping (`cudaHostRegister`,
`cudaHostUnregister`), its device address (`cudaHostGetDevicePointer`) and strided copies
(`cudaMemcpy2DAsync`).

Contract: a call that fails returns its cudaError and leaves no error pending. The runtime
keeps a failed call's error as the thread's "last error", and the next CUDA call of the
process that checks for launch errors (every torch kernel does) raises it: measured on an
H200, a second `cudaHostRegister` of the same memory failed (712) and the next `torch.randint`
raised `cudaErrorHostMemoryAlreadyRegistered`, a crash where kvcr promises "slower, never
broken". So each failure is followed at once by `cudaGetLastError` (returns and clears it),
counted (`failures`, by call name) and logged once per call name.

Where the calls go: the libcudart shared library torch loaded (`load_libcudart`, through
ctypes), else (torch linked statically) torch's own bindings for registration with a clearing
callback from the caller, and no strided copy. This module imports no torch (the torch seam
is kvcr_core.copyengine / kvcr_core.cudacopy); `PoolPins` keeps the pinned mappings' books.

Threading: the last error is per host thread, and each call clears in the thread that made
it. Counters and books are updated under the GIL; `PoolPins` is used under its engine's locks.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

log = logging.getLogger("kvcr_core.copies")
REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the addresses (UVA)
_CONSEQUENCE = {
    "cudaHostRegister": "copies of this mapping stay pageable: correct, slower (pin_failed)",
    "cudaHostUnregister": "the mapping may stay locked until the process exits",
    "cudaHostGetDevicePointer": "copies of this mapping go through DMA only",
    "cudaMemcpy2DAsync": "the copy failed: its blocks are not published or used",
}


class RuntimeCalls(Protocol):
    """The raw calls (ctypes on libcudart, torch's bindings, or a test's fake): each returns
    a cudaError (0 = success)."""

    def host_register(self, address: int, size: int, flags: int) -> int: ...

    def host_unregister(self, address: int) -> int: ...

    def host_device_pointer(self, address: int) -> tuple[int, int]: ...

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                       height: int, kind: int, stream: int) -> int: ...

    def get_last_error(self) -> int: ...

    @property
    def has_memcpy2d(self) -> bool: ...


class Libcudart:
    """`RuntimeCalls` through ctypes on one loaded libcudart."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        vp, sz, ui, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
        self._register = self._fn(lib, "cudaHostRegister", [vp, sz, ui])
        self._unregister = self._fn(lib, "cudaHostUnregister", [vp])
        try:  # only the zero-copy strategy needs it
            self._device_pointer: Callable[..., int] | None = self._fn(
                lib, "cudaHostGetDevicePointer", [ctypes.POINTER(vp), vp, ui])
        except AttributeError:
            self._device_pointer = None
        self._last_error = self._fn(lib, "cudaGetLastError", [])
        self._memcpy2d = self._fn(lib, "cudaMemcpy2DAsync", [vp, sz, vp, sz, sz, sz, i, vp])

    @staticmethod
    def _fn(lib: ctypes.CDLL, name: str, argtypes: list[type]) -> Callable[..., int]:
        function = getattr(lib, name)
        function.restype, function.argtypes = ctypes.c_int, argtypes
        found: Callable[..., int] = function
        return found

    @property
    def has_memcpy2d(self) -> bool:
        return True

    def host_register(self, address: int, size: int, flags: int) -> int:
        return self._register(address, size, flags)

    def host_unregister(self, address: int) -> int:
        return self._unregister(address)

    def host_device_pointer(self, address: int) -> tuple[int, int]:
        if self._device_pointer is None:
            return 0, 0  # unknown: no zero-copy
        pointer = ctypes.c_void_p()
        error = self._device_pointer(ctypes.byref(pointer), address, 0)
        return error, pointer.value or 0

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                       height: int, kind: int, stream: int) -> int:
        return self._memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream)

    def get_last_error(self) -> int:
        return self._last_error()


def load_libcudart(cuda_version: str | None) -> Libcudart | None:
    """The libcudart this process loaded (torch's: the one of `cuda_version`'s major first),
    or None if none is a shared library exporting what kvcr calls."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {parts[5] for line in maps.splitlines()
             if len(parts := line.split(maxsplit=5)) == 6 and "libcudart.so" in parts[5]}
    major = f"libcudart.so.{cuda_version.split('.')[0]}" if cuda_version else "\0"
    for path in sorted(paths, key=lambda p: (major not in p, p)):
        try:
            return Libcudart(ctypes.CDLL(path), path)
        except (OSError, AttributeError):
            continue
    return None


class CudaRuntime:
    """Checked calls: a failure is cleared (`cudaGetLastError`, or `clear` where the calls
    have none), counted and logged once per call name; the cudaError is returned."""

    def __init__(self, calls: RuntimeCalls, clear: Callable[[], None] | None = None) -> None:
        self.calls = calls
        self._clear = clear
        self.failures: dict[str, int] = {}
        self._logged: set[str] = set()

    @property
    def failures_total(self) -> int:
        return sum(self.failures.values())

    @property
    def has_memcpy2d(self) -> bool:
        return self.calls.has_memcpy2d

    def host_register(self, address: int, size: int, flags: int) -> int:
        return self._checked("cudaHostRegister", self.calls.host_register(address, size, flags))

    def host_unregister(self, address: int) -> int:
        return self._checked("cudaHostUnregister", self.calls.host_unregister(address))

    def host_device_pointer(self, address: int) -> int | None:
        error, pointer = self.calls.host_device_pointer(address)
        return None if self._checked("cudaHostGetDevicePointer", error) or not pointer \
            else pointer

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                       height: int, stream: int) -> int:
        return self._checked("cudaMemcpy2DAsync", self.calls.memcpy2d_async(
            dst, dpitch, src, spitch, width, height, MEMCPY_DEFAULT, stream))

    def _checked(self, name: str, error: int) -> int:
        error = int(error)
        if error == 0:
            return 0
        pending = self._clear_pending()
        self.failures[name] = self.failures.get(name, 0) + 1
        if name not in self._logged:
            self._logged.add(name)
            log.warning("kvcr: %s failed (cudaError %d; pending error cleared: %s); %s. "
                        "Logged once, counted.", name, error, pending, _CONSEQUENCE[name])
        return error

    def _clear_pending(self) -> str:
        try:
            return f"cudaError {int(self.calls.get_last_error())}"
        except (AttributeError, NotImplementedError):
            if self._clear is not None:
                self._clear()
                return "by a checked launch"
            return "no way to clear it"


class PoolPins:
    """The pool mappings this engine registered with CUDA: address -> (size, device address
    or None). A failed registration leaves the mapping pageable (`pin_failures`)."""

    def __init__(self, runtime: CudaRuntime) -> None:
        self.runtime = runtime
        self.pinned: dict[int, tuple[int, int | None]] = {}
        self.pin_failures = 0

    def pin(self, address: int, size: int) -> bool:
        start = time.perf_counter()
        if self.runtime.host_register(address, size, REGISTER_PORTABLE_MAPPED) != 0:
            self.pin_failures += 1
            return False
        device = self.runtime.host_device_pointer(address)
        self.pinned[address] = (size, device)
        log.info("kvcr: pinned the pool mapping for CUDA (%d MiB) in %.2f s", size >> 20,
                 time.perf_counter() - start)
        return True

    def unpin(self, address: int) -> None:
        if self.pinned.pop(address, None) is not None:
            self.runtime.host_unregister(address)

    def device_address(self, address: int, size: int) -> int | None:
        """The device address of [address, address + size) if one pinned mapping holds it."""
        for start, (length, device) in self.pinned.items():
            if device is not None and start <= address and address + size <= start + length:
                return device + (address - start)
        return None
