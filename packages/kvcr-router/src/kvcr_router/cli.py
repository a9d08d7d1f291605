"""`kvcr-router`: `serve` (the HTTP front in front of vLLM workers) and `simulate` (trace
replay, in `kvcr_router.simulate`, imported only when chosen), plus `--version`.

Every `serve` flag has a documented default (docs/router.md) and may also come from
`--config FILE` (YAML/JSON, same names); flags given on the command line win. The on/off
flags (`--trust-request-chat-template`, `--expose-cache-details`) only switch on; a file
may set them either way.
Exit codes: 0 ok, 2 usage or configuration error. `serve` runs the front's event loop on
the main thread until SIGINT/SIGTERM, with the GIL switch interval at 1 ms so that threads
decoding large bodies or tokenizing hold up the loop less (bodies.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvcr_core.errors import ConfigError
from kvcr_router._version import __version__
from kvcr_router.config import RouterConfig, read_config_file
from kvcr_router.cost import WEIGHT_PRESETS, CostWeights

log = logging.getLogger("kvcr_router")
# How long a thread decoding a large body (or tokenizing) may hold the GIL while the event
# loop waits for it: CPython's 5 ms default adds up over the loop's many turns per request.
SWITCH_INTERVAL_S = 0.001

_WEIGHT_HELP = {
    "device_w": "credit per block in the worker's engine cache (vLLM KV events)",
    "pool_w": "credit per block in the worker's kvcr pool (inventory)",
    "fetch_w": "credit per block the worker can fetch from a peer right after its own prefix",
    "prefill_scale": "weight of the prefill blocks left after credit",
    "decode_w": "weight per block (prompt + max_tokens) of requests in flight at the worker",
    "active_w": "weight per request in flight at the worker",
    "temperature": "0: cheapest worker; > 0: softmax sampling over -cost (seeded)",
    "min_fetch_blocks": "hint a source only if it holds at least this many blocks more "
                        "(the pull-versus-recompute crossover)",
}


def _serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI-compatible front in front of workers",
                           allow_abbrev=False,  # a shortened flag in a manifest must fail
                           description="Route OpenAI requests to vLLM workers with kvcr hints.")
    rc = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
    add = serve.add_argument
    add("--config", help="YAML/JSON file with any of these settings (flags win)")
    add("--listen", help="HOST:PORT to serve on (default 127.0.0.1:8000)")
    add("--worker", dest="workers", action="append", metavar="NAME=URL[,peer=..][,kv_events=..]",
        help="a worker (repeat): NAME=http://HOST:PORT of its vLLM server, peer=tcp://H:P of "
             "its kvcr peer endpoint (inventory and hint source), kv_events=tcp://H:P of "
             "vLLM's ZMQ KV event publisher")
    add("--namespace", help="the engines' kvcr namespace spec (TP rank 0): JSON or @FILE "
                            "(docs/keys.md; docs/router.md shows how to get it)")
    add("--namespace-digest", help="or just its digest (32 hex digits), with --block-size")
    add("--block-size", type=int, help="tokens per block (default: the namespace's)")
    add("--tokenizer", help="tokenizer folder or name (usually the model folder vLLM serves); "
                            "without it only token-id prompts get KV credit")
    add("--peer-secret-file", help="file with the shared kvcr peer secret (for inventory)")
    add("--peer-secret-env",
        help=f"environment variable with the secret (default {rc['peer_secret_env']})")
    add("--peer-node-key", help="this router's fleet key (kvcr fleet keygen), instead of the "
                                "shared secret: with --peer-fleet, it may read inventories "
                                "and nothing else")
    add("--peer-fleet", help="the fleet file, listing this router under `routers`")
    for name in ("health_interval_s", "health_timeout_s", "inventory_interval_s",
                 "inventory_timeout_s", "connect_timeout_s", "read_timeout_s"):
        add("--" + name.replace("_", "-"), type=float, help=f"default {rc[name]}")
    add("--max-body-bytes", type=int,
        help=f"largest request body; a longer one is refused (413) unread "
             f"(default {rc['max_body_bytes']})")
    add("--body-timeout-s", type=float,
        help=f"the whole request body must arrive within this, else 408 and the connection "
             f"closes (default {rc['body_timeout_s']})")
    add("--json-threads", type=int,
        help=f"threads that decode and encode large request bodies off the event loop "
             f"(default {rc['json_threads']})")
    add("--max-blocks-per-source", type=int,
        help=f"index bound per worker and tier (default {rc['max_blocks_per_source']})")
    _trust_flags(serve.add_argument_group("trust (docs/router.md \"Trust\")"), rc)
    weights = serve.add_argument_group("cost weights (docs/router.md)")
    weights.add_argument("--weights-preset", choices=sorted(WEIGHT_PRESETS),
                         help="base weights the flags below adjust: reference (default, the "
                              "reference router's) or tuned (the simulator's recommendation)")
    for field in dataclasses.fields(CostWeights):
        weights.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                             help=f"{_WEIGHT_HELP[field.name]} (default {field.default})")
    add("--log-level", default="INFO", help="default INFO")


def _trust_flags(group: Any, rc: dict[str, Any]) -> None:
    add = group.add_argument
    add("--trust-request-chat-template", action="store_true", default=None,
        help="render chat_template / chat_template_kwargs sent by clients (Jinja code: "
             "only for trusted clients); default: such requests are routed on load alone")
    add("--tokenize-threads", type=int,
        help=f"threads that tokenize prompts (default {rc['tokenize_threads']})")
    add("--tokenize-timeout-s", type=float,
        help="longest wait for a prompt's hashes; then the request is routed on load alone "
             f"(default {rc['tokenize_timeout_s']})")
    add("--max-pending-tokenize", type=int,
        help="tokenizations queued or running; past it requests are routed on load alone "
             "at once (default 4 x --tokenize-threads)")
    add("--max-prompt-chars", type=int,
        help="longest prompt text (or rendered chat) that is tokenized "
             f"(default {rc['max_prompt_chars']})")
    add("--expose-cache-details", action="store_true", default=None,
        help="give every client /kvcr/explain and the x-kvcr-* response headers (they tell "
             "which blocks of a prompt are cached); default: operator token holders only")
    add("--operator-token-file",
        help="file with a token: requests whose X-KVCR-Operator-Token header carries it see "
             "cache details")
    add("--operator-token-env",
        help=f"or the environment variable holding it, if set (default "
             f"{rc['operator_token_env']})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcr-router",
                                     description="KV-aware router for kvcr workers")
    parser.add_argument("--version", action="version", version=f"kvcr-router {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    sub.add_parser("simulate", add_help=False,
                   help="replay a trace to compare and tune routing policies (see --help)")
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    data = read_config_file(args.config) if args.config else {}
    skip = {"command", "config", "log_level"}
    data.update({k: v for k, v in vars(args).items() if v is not None and k not in skip})
    return RouterConfig.from_mapping(data)


def serve(config: RouterConfig) -> int:
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from kvcr_core.attach import secret_from
    from kvcr_core.exposition import process_metrics
    from kvcr_router.front import Router
    from kvcr_router.hashing import HfTokenizer, PromptHasher

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    secret = None
    if any(w.peer for w in config.workers):
        secret = secret_from(config.peer_secret_file, config.peer_secret_env,
                             node_key=config.peer_node_key, fleet=config.peer_fleet)
    tokenizer = HfTokenizer(config.tokenizer) if config.tokenizer else None
    hasher = PromptHasher(config.namespace_digest, config.block_size, tokenizer)
    registry = CollectorRegistry()
    process_metrics(registry, "kvcr-router", __version__)
    router = Router(config, hasher, registry, secret=secret)
    log.info("kvcr-router %s on http://%s:%d: workers %s, namespace %s, block size %d",
             __version__, config.listen_host, config.listen_port,
             ", ".join(w.name for w in config.workers), config.namespace_digest.hex(),
             config.block_size)
    log.info("request chat templates %s; cache details %s (docs/router.md \"Trust\")",
             "rendered" if config.trust_request_chat_template else "not rendered",
             "exposed to all" if config.expose_cache_details else
             "for operator token holders" if not router.access.closed else "hidden")
    web.run_app(router.app(), host=config.listen_host, port=config.listen_port, print=None,
                access_log=None, shutdown_timeout=5)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:
        from kvcr_router.simulate import main as simulate

        return simulate(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        return serve(config)
    except ConfigError as exc:
        print(f"kvcr-router: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
