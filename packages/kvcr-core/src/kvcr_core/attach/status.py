"""The status report an operator reads with `kvcr status` (the attach protocol's `Probe`):
the server's version, its attached clients (by identity, escaped) and every namespace's pool,
as JSON (fields: docs/monitoring.md). Pure: built from what the caller passes; run on the
server's loop thread.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import Any

from kvcr_core._version import __version__
from kvcr_core.logs import printable
from kvcr_core.runner import Runner


def status_report(runner: Runner, *, socket_path: str, started_s: float,
                  attached: Iterable[tuple[bytes, str]], peer_endpoint: str | None) -> str:
    """`attached`: (namespace digest, identity) of each attached client."""
    clients: dict[bytes, int] = {}
    identities: list[str] = []
    for digest, identity in attached:
        clients[digest] = clients.get(digest, 0) + 1
        identities.append(printable(identity))
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
        "uptime_s": round(time.monotonic() - started_s, 3), "clients": len(identities),
        "identities": sorted(identities),
        "peer_endpoint": peer_endpoint, "pool_bytes": runner.config.pool_bytes,
        "namespaces": namespaces})
