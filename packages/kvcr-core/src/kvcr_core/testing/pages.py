"""What this process's page tables hold of a mapping: `mapped_kib(address)`, the Rss that
/proc/self/smaps reports for the mapping starting at `address` (Linux only); and what exists
of a shared mapping's memory whoever backed it: `resident_kib(address, length)` (mincore).
How tests see whether a pool's pages were backed or mapped ahead of use, without timing."""

from __future__ import annotations

import ctypes
import mmap


def resident_kib(address: int, length: int) -> int:
    """KiB of [address, address + length) in memory (for a shared file mapping: backed by any
    process), found without faulting a page in."""
    pages = -(-length // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in bytes(vector)) * mmap.PAGESIZE // 1024


def mapped_kib(address: int) -> int:
    """KiB of the mapping that starts at `address` present in this process's page tables."""
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    head = f"{address:x}-"
    start = next((i for i, line in enumerate(lines) if line.startswith(head)), None)
    if start is None:
        raise LookupError(f"no mapping starts at {address:#x} in /proc/self/smaps")
    rss = next(line for line in lines[start + 1:] if line.startswith("Rss:"))
    return int(rss.split()[1])
