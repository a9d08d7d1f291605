"""The status report an operator reads with `kvcr status` (the attach protocol's `Probe`):
the server's version, its attached clients (by identity, escaped), every namespace's pool and
what it is (model, TP, block size, layout), and the namespaces of one model that can never
share blocks (`unshared`: engines of other TP sizes, block sizes, dtypes or vLLM builds, so
an operator sees why their reuse is zero), as JSON (fields: docs/monitoring.md).
`status_report` is pure (built from what the caller passes; run on the server's loop
thread); `probe_status` asks a server for it (`kvcr status`, and engines that check
kvcr-guard's peer endpoint).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Collection, Iterable
from typing import Any

from kvcr_core._version import __version__
from kvcr_core.attach import protocol as p
from kvcr_core.keys import NamespaceSpec
from kvcr_core.logs import printable
from kvcr_core.runner import Runner

SHARING_FIELDS = ("tp_size", "block_size_tokens", "dtype", "kv_dtype", "layout", "head_dim",
                  "num_kv_heads", "num_layers")
"""Fields that differ between two engines of one model whose blocks can never be shared."""
_GROUP_EXTRA = ("kv_group", "attention")  # one engine's own namespaces, not a mismatch


def described(spec: NamespaceSpec) -> dict[str, Any]:
    """What `kvcr status` shows of a namespace."""
    return {"model": spec.model_id, "revision": spec.model_revision, "tenant": spec.tenant,
            "lora": spec.lora, "tp_size": spec.tp_size, "tp_rank": spec.tp_rank,
            "block_size_tokens": spec.block_size_tokens, "dtype": spec.dtype,
            "kv_dtype": spec.kv_dtype, "layout": spec.layout, "head_dim": spec.head_dim,
            "num_kv_heads": spec.num_kv_heads, "num_layers": spec.num_layers,
            "extra": dict(spec.extra)}


def unshared(specs: dict[bytes, NamespaceSpec]) -> list[dict[str, Any]]:
    """Namespaces of one model (and revision, tenant, adapter, KV cache group) that differ in
    a field that keeps their blocks apart: per such model, the fields and their values."""
    groups: dict[tuple[Any, ...], dict[bytes, NamespaceSpec]] = {}
    for digest, spec in specs.items():
        key = (spec.model_id, spec.model_revision, spec.tenant, spec.lora,
               *(spec.extra.get(k, "") for k in _GROUP_EXTRA))
        groups.setdefault(key, {})[digest] = spec
    found = []
    for key, members in groups.items():
        differs = {name: sorted({getattr(s, name) for s in members.values()}, key=str)
                   for name in SHARING_FIELDS}
        differs = {name: values for name, values in differs.items() if len(values) > 1}
        if differs:
            found.append({"model": key[0], "differs": differs,
                          "namespaces": sorted(d.hex() for d in members)})
    return sorted(found, key=lambda entry: str(entry["model"]))


def status_report(runner: Runner, *, socket_path: str, started_s: float,
                  attached: Iterable[tuple[Iterable[bytes], str]],
                  peer_endpoint: str | None,
                  shown: Collection[bytes] | None = None) -> str:
    """`attached`: (namespace digests, identity) of each attached client; `shown`: the only
    namespaces to show (None: all)."""
    clients: dict[bytes, int] = {}
    identities: list[str] = []
    for digests, identity in attached:
        for digest in digests:
            clients[digest] = clients.get(digest, 0) + 1
        identities.append(printable(identity))
    namespaces: list[dict[str, Any]] = []
    specs: dict[bytes, NamespaceSpec] = {}
    for digest in runner.namespaces:
        if shown is not None and digest not in shown:
            continue
        store = runner.namespace(digest)
        idx, pool = store.index, store.pool
        if store.spec is not None:
            specs[digest] = store.spec
        namespaces.append({**(described(store.spec) if store.spec is not None else {}),
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
        "namespaces": namespaces, "unshared": unshared(specs)})


def probe_status(socket_path: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The status of the server on `socket_path` (raises OSError, ConnectionError)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(socket_path)
        sock.sendall(p.encode_frame(p.Probe(p.PROTOCOL_VERSION)))
        payload, _ = p.recv_frame(sock)
    message = p.decode_server(payload)
    if isinstance(message, p.Goodbye):
        raise ConnectionError(f"refused ({message.reason}): {message.detail}")
    if not isinstance(message, p.StatusReport):
        raise ConnectionError(f"unexpected answer {type(message).__name__}")
    data: dict[str, Any] = json.loads(message.json)
    return data
