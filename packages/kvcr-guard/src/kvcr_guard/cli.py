"""`kvcr-guard` command line: flags (and an optional kvcr config file) -> `GuardConfig`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvcr_core.attach import DEFAULT_SECRET_ENV, PeerConfig, ServerConfig, secret_from
from kvcr_core.config import load_config
from kvcr_core.errors import ConfigError
from kvcr_core.peers import PeerTLS
from kvcr_guard._version import __version__
from kvcr_guard.config import GuardConfig


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvcr-guard", description="Own the kvcr pool so KV cache outlives engine crashes "
        "and is shared by every engine on the node.")
    ap.add_argument("--version", action="version", version=f"kvcr-guard {__version__}")
    ap.add_argument("--socket", required=True, help="Unix socket path to serve (mode 0600)")
    ap.add_argument("--pool-bytes", help="total pool size, e.g. 8GiB (default from config)")
    ap.add_argument("--namespace-pool-bytes",
                    help="pool size per namespace (model/TP rank...), e.g. 2GiB")
    ap.add_argument("--config", help="a kvcr config file (.json/.yaml); flags win over it")
    ap.add_argument("--allowed-uid", type=int, action="append", default=None,
                    help="uid allowed to attach (repeatable; default: this process's uid)")
    ap.add_argument("--metrics-host", default="127.0.0.1", help="Prometheus /metrics address")
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="Prometheus /metrics port (0 = any free port; default: off)")
    ap.add_argument("--peer-listen", default="",
                    help="serve blocks to authenticated peers on HOST:PORT (default: off)")
    ap.add_argument("--peer", action="append", default=[],
                    help="tcp://HOST:PORT of a peer clients may ask this daemon to fetch from "
                    "(repeatable)")
    ap.add_argument("--peer-secret-file", help="file holding the shared peer secret")
    ap.add_argument("--peer-tls", nargs=3, metavar=("CERT", "KEY", "CA"),
                    help="TLS for the peer channel: this node's PEM certificate and key, and "
                    "the CA peers' certificates must chain to (mutual)")
    ap.add_argument("--peer-nixl", action="store_true",
                    help="move peer transfers to NIXL when both sides have it (pip install "
                    "'kvcr-core[nixl]'); NIXL exposes the pool to authenticated peers for "
                    "writes too, so use it only among trusted nodes (docs/peers.md)")
    ap.add_argument("--peer-secret-env", default=DEFAULT_SECRET_ENV,
                    help=f"environment variable holding the secret (default {DEFAULT_SECRET_ENV})")
    ap.add_argument("--log-level", default=None,
                    help="DEBUG, INFO, WARNING, ERROR (default from config: INFO)")
    return ap


def config_from_args(args: argparse.Namespace) -> GuardConfig:
    overrides: dict[str, Any] = {}
    if args.pool_bytes is not None:
        overrides["pool_bytes"] = args.pool_bytes
    if args.namespace_pool_bytes is not None:
        overrides["namespace_pool_bytes"] = args.namespace_pool_bytes
    if args.log_level is not None:
        overrides["log_level"] = args.log_level
    runner = load_config(args.config, overrides=overrides)
    secret = (secret_from(args.peer_secret_file, args.peer_secret_env)
              if args.peer_listen or args.peer else None)
    peer = PeerConfig(listen=args.peer_listen, secret=secret, peers=frozenset(args.peer),
                      tls=PeerTLS(*args.peer_tls) if args.peer_tls else None,
                      nixl=args.peer_nixl)
    extra: dict[str, Any] = {}
    if args.allowed_uid:
        extra["allowed_uids"] = frozenset(args.allowed_uid)
    server = ServerConfig(socket_path=args.socket, runner=runner, peer=peer, **extra)
    return GuardConfig(server=server, metrics_host=args.metrics_host,
                       metrics_port=args.metrics_port)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kvcr-guard: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.server.runner.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvcr_guard.daemon import GuardDaemon

    daemon = GuardDaemon(config)
    try:
        daemon.listen()
    except (RuntimeError, OSError) as exc:
        print(f"kvcr-guard: {exc}", file=sys.stderr)
        return 1
    return daemon.run()
