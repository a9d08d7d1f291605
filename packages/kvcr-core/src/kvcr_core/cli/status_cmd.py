"""`kvcr status`: the state of a kvcr runner's pool, for an operator: kvcr-guard's
(`--socket PATH`), or embedded runners', found by their abstract socket (`--socket @name`,
or `--embedded [MATCH]`: every one in this network namespace, or those whose socket name or
attached engine identity contains MATCH). Fields: docs/monitoring.md."""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec

from kvcr_core.attach import protocol as p
from kvcr_core.attach.status import probe_status as fetch_status


def socket_address(path: str) -> str:
    """A socket path as given on the command line: "@name" is the abstract socket "name"
    (embedded runners), anything else a filesystem path."""
    return "\0" + path[1:] if path.startswith("@") else path


def embedded_sockets(proc_net_unix: str = "/proc/net/unix") -> list[str]:
    """The listening abstract sockets of kvcr runners in this network namespace (vLLM:
    `@kvcr-embedded-ENGINE`, SGLang: `@kvcr-sglang-PID`), as "@name"."""
    found = set()
    with open(proc_net_unix, encoding="ascii", errors="replace") as table:
        next(table, None)
        for line in table:
            fields = line.split()  # Num RefCount Protocol Flags Type St Inode Path
            if len(fields) >= 8 and fields[5] == "01" and fields[7].startswith("@kvcr-"):
                found.add(fields[7])
    return sorted(found)


def run_status(socket_path: str | None, *, as_json: bool, embedded: str | None = None) -> int:
    """One runner's status (`socket_path`), or every embedded runner's whose socket name or
    attached identities contain `embedded` (all of them for "")."""
    if embedded is None:
        assert socket_path is not None
        return _show([socket_path], as_json=as_json, match=None)
    sockets = embedded_sockets()
    if not sockets:
        print("kvcr status: no embedded kvcr runner listens in this network namespace (run "
              "it where the engine runs, e.g. kubectl exec into the engine's pod)",
              file=sys.stderr)
        return 1
    return _show(sockets, as_json=as_json, match=embedded)


def _show(sockets: list[str], *, as_json: bool, match: str | None) -> int:
    """Reports every runner it can read; one it cannot (hung, shutting down) is named on
    stderr and hides none of the others. Exit 1: nothing to show, or, when listing every
    runner, one could not be read."""
    reports = []
    unreadable = 0
    for path in sockets:
        try:
            status = fetch_status(socket_address(path))
        except (OSError, p.FrameError, msgspec.MsgspecError, ValueError) as exc:
            print(f"kvcr status: cannot read {path}: {exc}", file=sys.stderr)
            unreadable += 1
            continue
        if match and match not in path and not any(match in i for i in status["identities"]):
            continue
        reports.append(status)
    if match is not None and not reports:
        print(f"kvcr status: no embedded runner matches {match!r}", file=sys.stderr)
        return 1
    if not reports:
        return 1
    if as_json:
        print(json.dumps(reports[0] if match is None else reports, indent=2))
    else:
        for status in reports:
            _print_table(status)
    return 1 if unreadable and not match else 0


def _print_table(status: dict[str, Any]) -> None:
    print(f"kvcr runner {status['version']} pid {status['pid']} on {status['socket']}: "
          f"up {status['uptime_s']:.0f} s, {status['clients']} clients "
          f"({', '.join(status['identities']) or 'none'}), "
          f"pool {status['pool_bytes'] / 2**30:.2f} GiB, "
          f"peers {status['peer_endpoint'] or 'not served'}")
    print(f"{'namespace':16} {'block':>9} {'slots':>8} {'ready':>8} {'filling':>7} "
          f"{'free':>8} {'leased':>6} {'evictions':>9} {'clients':>7}")
    for ns in status["namespaces"]:
        print(f"{ns['namespace'][:16]:16} {ns['block_bytes']:>9} {ns['capacity_slots']:>8} "
              f"{ns['ready_blocks']:>8} {ns['filling_blocks']:>7} {ns['free_slots']:>8} "
              f"{ns['leased_slots']:>6} {ns['evictions']:>9} {ns['clients']:>7}"
              + (f"  {ns['model']} tp{ns['tp_rank']}/{ns['tp_size']}" if "model" in ns else ""))
    for entry in status.get("unshared", ()):
        fields = "; ".join(f"{name} {', '.join(str(v) for v in values)}"
                           for name, values in entry["differs"].items())
        print(f"NOTE model {entry['model']}: {len(entry['namespaces'])} namespaces never share "
              f"blocks (they differ in {fields}): engines of different TP sizes, block sizes, "
              "dtypes or engine builds recompute each other's prompts (docs/compatibility.md)")
