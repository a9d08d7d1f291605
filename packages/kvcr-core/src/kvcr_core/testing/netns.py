"""Two throwaway network namespaces joined by a veth pair (root only): the "two hosts" of
peer tests and benchmarks. Creates and removes system state."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator


@contextlib.contextmanager
def network_namespaces(tag: str, subnet: int) -> Iterator[tuple[str, str, str] | None]:
    """Namespaces `kvcr<tag>a` (10.201.<subnet>.1) and `kvcr<tag>b` (.2) joined by a veth
    pair; yields (a, b, address of a), or None when they cannot be made (not root, no
    iproute2). Removed on exit, and before creation in case a crashed run left them."""
    names = (f"kvcr{tag}a", f"kvcr{tag}b")

    def remove() -> None:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30,
                           check=False)

    if os.geteuid() != 0 or shutil.which("ip") is None:
        yield None
        return
    a, b = names
    va, vb = f"kvcr{tag}va", f"kvcr{tag}vb"
    steps = [("netns", "add", a), ("netns", "add", b),
             ("link", "add", va, "type", "veth", "peer", "name", vb),
             ("link", "set", va, "netns", a), ("link", "set", vb, "netns", b),
             ("-n", a, "addr", "add", f"10.201.{subnet}.1/24", "dev", va),
             ("-n", b, "addr", "add", f"10.201.{subnet}.2/24", "dev", vb),
             ("-n", a, "link", "set", va, "up"), ("-n", b, "link", "set", vb, "up"),
             ("-n", a, "link", "set", "lo", "up"), ("-n", b, "link", "set", "lo", "up")]
    remove()
    try:
        for step in steps:
            subprocess.run(["ip", *step], check=True, capture_output=True, timeout=30)
    except subprocess.CalledProcessError:
        remove()
        yield None
        return
    try:
        yield a, b, f"10.201.{subnet}.1"
    finally:
        remove()
