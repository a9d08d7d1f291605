"""`kvcr`: the operator's and router author's command line.

Subcommands: `bench pool`, `bench guard`, `config check FILE`, `keys --namespace SPEC TOKENS_FILE`,
`status --socket PATH`, `--version`. Each subcommand lives in its own module and is
imported only when chosen, so `kvcr --version` stays instant.
Exit codes: 0 ok, 1 failed check, 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

from kvcr_core._version import __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcr", description="kvcr KV Cache Runner tools")
    parser.add_argument("--version", action="version", version=f"kvcr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="measure kvcr against a same-run baseline")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    pool = bench_sub.add_parser("pool", help="pool copy-in/out vs memcpy, index speed and size")
    pool.add_argument("--quick", action="store_true", help="short run (under 30 s)")
    pool.add_argument("--json", action="store_true", help="print one JSON object")
    guard = bench_sub.add_parser(
        "guard", help="copy path through kvcr-guard, control round trip, attach time")
    guard.add_argument("--quick", action="store_true", help="short run")
    guard.add_argument("--json", action="store_true", help="print one JSON object")
    peer = bench_sub.add_parser("peer", help="peer transports (TCP, NIXL) vs raw, fetch latency")
    peer.add_argument("--quick", action="store_true", help="short run")
    peer.add_argument("--json", action="store_true", help="print one JSON object")
    for plugin in _bench_plugins():  # e.g. `kvcr bench vllm` from kvcr-vllm
        extra = bench_sub.add_parser(plugin.name, help=f"benchmark from {plugin.value}")
        extra.add_argument("--quick", action="store_true", help="short run")
        extra.add_argument("--json", action="store_true", help="print one JSON object")

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config", required=True)
    check = config_sub.add_parser("check", help="validate a config file and print the result")
    check.add_argument("file", help="a .json, .yaml or .yml config file")
    check.add_argument("--no-env", action="store_true",
                       help="ignore KVCR_* environment variables")

    status = sub.add_parser("status", help="print the state of a kvcr-guard pool")
    status.add_argument("--socket", required=True, help="the kvcr-guard socket path")
    status.add_argument("--json", action="store_true", help="print JSON")

    keys = sub.add_parser("keys", help="print block keys and router hashes of a token list")
    keys.add_argument("--namespace", required=True,
                      help="namespace spec: a JSON object or @FILE with one (see docs/keys.md)")
    keys.add_argument("tokens_file",
                      help="token ids: a JSON list, or whitespace/comma separated ints; - = stdin")
    keys.add_argument("--scheme", default="kvcr-v1", help="router hash scheme")
    keys.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _bench_plugins() -> list[importlib.metadata.EntryPoint]:
    """Benchmarks other kvcr packages install (entry point group `kvcr.bench`)."""
    found = importlib.metadata.entry_points(group="kvcr.bench")
    return [ep for ep in found if ep.name not in ("pool", "guard", "peer")]


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "bench" and args.bench == "guard":
        from kvcr_core.cli.bench_guard import run_guard_bench

        return run_guard_bench(quick=args.quick, as_json=args.json)
    if args.command == "bench" and args.bench == "peer":
        from kvcr_core.cli.bench_peer import run_peer_bench

        return run_peer_bench(quick=args.quick, as_json=args.json)
    if args.command == "bench" and args.bench != "pool":
        (plugin,) = [ep for ep in _bench_plugins() if ep.name == args.bench]
        result: int = plugin.load()(quick=args.quick, as_json=args.json)
        return result
    if args.command == "bench":
        from kvcr_core.cli.bench_pool import run_pool_bench

        return run_pool_bench(quick=args.quick, as_json=args.json)
    if args.command == "config":
        from kvcr_core.cli.config_cmd import run_config_check

        return run_config_check(args.file, use_env=not args.no_env)
    if args.command == "status":
        from kvcr_core.cli.status_cmd import run_status

        return run_status(args.socket, as_json=args.json)
    if args.command == "keys":
        from kvcr_core.cli.keys_cmd import run_keys

        return run_keys(args.namespace, args.tokens_file, scheme=args.scheme, as_json=args.json)
    return 2  # pragma: no cover - argparse enforces a subcommand


if __name__ == "__main__":
    sys.exit(main())
