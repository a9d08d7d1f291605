"""The status report an operator reads with `kvcr status` (the attach protocol's `Probe`):
the server's version, clients and every namespace's pool, as JSON. Pure: built from what the
caller passes; run on the server's loop thread.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import Any

from kvcr_core._version import __version__
from kvcr_core.runner import Runner


def status_report(runner: Runner, *, socket_path: str, started_s: float,
                  attached: Iterable[bytes | None], peer_endpoint: str | None) -> str:
    """`attached`: the namespace digest of each attached client (None: not attached)."""
    clients: dict[bytes, int] = {}
    total = 0
    for digest in attached:
        if digest is not None:
            clients[digest] = clients.get(digest, 0) + 1
            total += 1
    namespaces: list[dict[str, Any]] = []
    for digest in runner.namespaces:
        store = runner.namespace(digest)
        idx, pool = store.index, store.pool
        namespaces.append({
            "namespace": digest.hex(), "block_bytes": pool.slot_bytes,
            "capacity_slots": idx.capacity_slots, "ready_blocks": idx.ready_blocks,
            "filling_blocks": idx.filling_blocks, "free_slots": idx.free_slots,
            "leased_slots": idx.leased_slots, "open_reservations": idx.open_reservations,
            "open_leases": idx.open_leases, "evictions": idx.evictions,
            "pool_bytes": pool.region.size_bytes, "clients": clients.get(digest, 0)})
    return json.dumps({
        "version": __version__, "pid": os.getpid(), "socket": socket_path.replace("\0", "@"),
        "uptime_s": round(time.monotonic() - started_s, 3), "clients": total,
        "peer_endpoint": peer_endpoint, "pool_bytes": runner.config.pool_bytes,
        "namespaces": namespaces})
