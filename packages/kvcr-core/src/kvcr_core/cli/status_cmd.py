"""`kvcr status --socket PATH`: the state of a kvcr-guard pool, for an operator."""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

import msgspec

from kvcr_core.attach import protocol as p


def fetch_status(socket_path: str, timeout_s: float = 5.0) -> dict[str, Any]:
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


def run_status(socket_path: str, *, as_json: bool) -> int:
    try:
        status = fetch_status(socket_path)
    except (OSError, p.FrameError, msgspec.MsgspecError, ValueError) as exc:
        print(f"kvcr status: cannot read {socket_path}: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"kvcr-guard {status['version']} pid {status['pid']} on {status['socket']}: "
          f"up {status['uptime_s']:.0f} s, {status['clients']} clients, "
          f"pool {status['pool_bytes'] / 2**30:.2f} GiB")
    print(f"{'namespace':16} {'block':>9} {'slots':>8} {'ready':>8} {'filling':>7} "
          f"{'free':>8} {'leased':>6} {'evictions':>9} {'clients':>7}")
    for ns in status["namespaces"]:
        print(f"{ns['namespace'][:16]:16} {ns['block_bytes']:>9} {ns['capacity_slots']:>8} "
              f"{ns['ready_blocks']:>8} {ns['filling_blocks']:>7} {ns['free_slots']:>8} "
              f"{ns['leased_slots']:>6} {ns['evictions']:>9} {ns['clients']:>7}")
    return 0
