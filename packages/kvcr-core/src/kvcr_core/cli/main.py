"""`kvcr`: the operator's and router author's command line.

Subcommands: `bench NAME` (the benchmarks kvcr-bench installs: pool, guard, peer, vllm,
serve, sglang, pull, dynamo, copy), `config check FILE`, `keys --namespace SPEC TOKENS_FILE`,
`secret generate`, `fleet keygen`, `status --socket PATH`, `--version`. Each subcommand
lives in its own module and is imported only when chosen, so `kvcr --version` stays instant.
Exit codes: 0 ok, 1 failed check, 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

from kvcr_core._version import __version__


def _serve_options(parser: argparse.ArgumentParser) -> None:
    """`kvcr bench serve`'s own options (kvcr-bench's serve_load has the defaults)."""
    parser.add_argument("--prefill-cap", type=int, metavar="TOKENS",
                        help="vLLM's --long-prefill-token-threshold for kvcr's engines and a "
                        "second vanilla case (0: none; default 256)")
    parser.add_argument("--back-ahead", metavar="SIZE",
                        help="kvcr-guard's --back-ahead in kvcr's case (default: its whole "
                        "pool before the load, steady state; 256MiB: backed as it fills, a "
                        "node's first fill)")
    parser.add_argument("--cap-rule", choices=("kvcr", "vllm"),
                        help="when the capped engines hold the cap: kvcr (default; only while "
                        "another request wants prefill tokens) or vllm (while any other "
                        "request runs)")


def _bench_options(name: str, parser: argparse.ArgumentParser) -> None:
    """`kvcr bench NAME`'s options: --quick and --json, and the benchmark's own."""
    parser.add_argument("--quick", action="store_true", help="short run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    if name == "guard":
        parser.add_argument("--under-attack", action="store_true",
                            help="a legitimate engine's round trip while another client "
                            "misbehaves, one way at a time")
    if name == "serve":
        _serve_options(parser)
    if name == "vllm":
        parser.add_argument("--modes", default=None, metavar="MODES",
                            help="engine modes to time, comma-separated: inproc, mp "
                            "(default both)")
    if name == "copy":
        parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                            help="where the KV tensors live (auto: cuda when available)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcr", description="kvcr KV Cache Runner tools")
    parser.add_argument("--version", action="version", version=f"kvcr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="measure kvcr against a same-run baseline "
                           "(kvcr-bench, installed from this repository)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    installed = {ep.name: ep for ep in _bench_plugins()}
    for name in sorted({*BENCHMARKS, *installed}):
        where = installed[name].value if name in installed else "not installed"
        extra = bench_sub.add_parser(name, help=BENCHMARKS.get(name, f"benchmark ({where})"))
        _bench_options(name, extra)

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config", required=True)
    check = config_sub.add_parser("check", help="validate a config file and print the result")
    check.add_argument("file", help="a .json, .yaml or .yml config file")
    check.add_argument("--no-env", action="store_true",
                       help="ignore KVCR_* environment variables")

    secret = sub.add_parser("secret", help="peer secrets")
    secret_sub = secret.add_subparsers(dest="secret", required=True)
    generate = secret_sub.add_parser("generate", help="make a strong shared peer secret")
    generate.add_argument("--out", help="write it to this new file (mode 0600) instead of "
                          "printing it")

    fleet = sub.add_parser("fleet", help="fleet identities (one key per node and router)")
    fleet_sub = fleet.add_subparsers(dest="fleet", required=True)
    keygen = fleet_sub.add_parser("keygen", help="make a node's (or router's) key")
    keygen.add_argument("--out", required=True, help="the new key file (mode 0600)")
    keygen.add_argument("--name", required=True, help="the node's name in the fleet file")

    status = sub.add_parser("status", help="print the state of a kvcr runner's pool")
    target = status.add_mutually_exclusive_group(required=True)
    target.add_argument("--socket", help="the kvcr-guard socket path, or @NAME for an embedded "
                       "runner's abstract socket")
    target.add_argument("--embedded", nargs="?", const="", metavar="MATCH",
                       help="every embedded runner in this network namespace (or those whose "
                       "socket or attached engine identity contains MATCH)")
    status.add_argument("--json", action="store_true", help="print JSON")

    keys = sub.add_parser("keys", help="print block keys and router hashes of a token list")
    keys.add_argument("--namespace", required=True,
                      help="namespace spec: a JSON object or @FILE with one (see docs/keys.md)")
    keys.add_argument("tokens_file",
                      help="token ids: a JSON list, or whitespace/comma separated ints; - = stdin")
    keys.add_argument("--scheme", default="kvcr-v1", help="router hash scheme")
    keys.add_argument("--json", action="store_true", help="print JSON")
    return parser


BENCHMARKS = {
    "pool": "pool copy-in/out vs memcpy, index speed and size",
    "guard": "copy path through kvcr-guard, control round trip, attach time",
    "peer": "peer transports (TCP, NIXL) vs raw, fetch latency",
    "vllm": "TTFT on real vLLM: recompute / local hit / kvcr / ExampleConnector",
    "serve": "vLLM OpenAI servers under vllm bench serve: TTFT p90 and throughput vs load",
    "sglang": "HiCache v1 throughput vs SGLang's file backend vs memcpy",
    "pull": "cross-node reuse on real vLLM: pull on miss vs a hint vs a local hit",
    "dynamo": "multi-turn TTFT through NVIDIA Dynamo's KV router: vanilla vs kvcr workers",
    "copy": "pool <-> KV tensor copies (CPU or CUDA) vs one pinned copy of the same bytes",
    "tier": "kvcr as a tier of vLLM's OffloadingConnector: lookups, store/promote vs memcpy",
}


def _bench_plugins() -> list[importlib.metadata.EntryPoint]:
    """Benchmarks installed as entry points (group `kvcr.bench`; kvcr-bench has them all)."""
    return list(importlib.metadata.entry_points(group="kvcr.bench"))


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "bench":
        found = [ep for ep in _bench_plugins() if ep.name == args.bench]
        if not found:
            print(f"kvcr bench {args.bench}: the benchmarks are not installed; install "
                  "kvcr-bench from this repository (it is not on PyPI): in a clone of "
                  "https://github.com/kvcr-project/kvcr, pip install "
                  "'./packages/kvcr-bench[guard]' (its README has the vllm / sglang extras)",
                  file=sys.stderr)
            return 2
        options: dict[str, object] = (
            {"under_attack": True} if getattr(args, "under_attack", False) else {})
        for option in ("device", "prefill_cap", "back_ahead", "cap_rule", "modes"):
            if getattr(args, option, None) is not None:
                options[option] = getattr(args, option)
        result: int = found[0].load()(quick=args.quick, as_json=args.json, **options)
        return result
    if args.command == "config":
        from kvcr_core.cli.config_cmd import run_config_check

        return run_config_check(args.file, use_env=not args.no_env)
    if args.command == "secret":
        from kvcr_core.cli.secret_cmd import run_secret_generate

        return run_secret_generate(args.out)
    if args.command == "fleet":
        from kvcr_core.cli.secret_cmd import run_fleet_keygen

        return run_fleet_keygen(args.out, args.name)
    if args.command == "status":
        from kvcr_core.cli.status_cmd import run_status

        return run_status(args.socket, as_json=args.json, embedded=args.embedded)
    if args.command == "keys":
        from kvcr_core.cli.keys_cmd import run_keys

        return run_keys(args.namespace, args.tokens_file, scheme=args.scheme, as_json=args.json)
    return 2  # pragma: no cover - argparse enforces a subcommand


if __name__ == "__main__":
    sys.exit(main())
