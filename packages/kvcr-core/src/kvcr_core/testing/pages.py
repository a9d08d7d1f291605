"""What this process's page tables hold of a mapping: `mapped_kib(address)`, the Rss that
/proc/self/smaps reports for the mapping starting at `address` (Linux only). How tests see
whether a pool's pages were mapped ahead of use, without timing anything."""

from __future__ import annotations


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
