"""`kvcr-guard` command line: flags (and an optional kvcr config file) -> `GuardConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvcr_core.attach import (
    DEFAULT_SECRET_ENV,
    ClientLimits,
    PeerConfig,
    ServerConfig,
    secret_from,
)
from kvcr_core.config import load_config, parse_size_bytes
from kvcr_core.errors import ConfigError
from kvcr_core.peers import PeerTLS
from kvcr_guard._version import __version__
from kvcr_guard.config import DEFAULT_NAMESPACE_IDLE_S, DEFAULT_NAMESPACE_SHARE, GuardConfig


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: a shortened or misspelt flag in a manifest must fail, not pass.
    ap = argparse.ArgumentParser(
        prog="kvcr-guard", allow_abbrev=False,
        description="Own the kvcr pool so KV cache outlives engine crashes and is shared by "
        "every engine on the node.")
    ap.add_argument("--version", action="version", version=f"kvcr-guard {__version__}")
    ap.add_argument("--socket", required=True, help="Unix socket path to serve (mode 0600)")
    ap.add_argument("--pool-bytes", help="total pool size, e.g. 8GiB (default from config)")
    ap.add_argument("--namespace-pool-bytes",
                    help="pool size per namespace (model/TP rank...), e.g. 2GiB (default: a "
                    f"1/{DEFAULT_NAMESPACE_SHARE} share of the pool, so no namespace can take "
                    "all of it)")
    ap.add_argument("--config", help="a kvcr config file (.json/.yaml); flags win over it")
    _access_flags(ap)
    ap.add_argument("--client-held-fraction", type=float, default=ClientLimits.held_fraction,
                    help="share of a namespace's slots one client may hold writing or "
                    f"reading at once (default {ClientLimits.held_fraction})")
    ap.add_argument("--client-max-ops", type=int, default=ClientLimits.ops,
                    help=f"open reservations and leases per client (default {ClientLimits.ops})")
    ap.add_argument("--namespace-idle-s", type=float, default=DEFAULT_NAMESPACE_IDLE_S,
                    help="a namespace nobody used for this long gives its memory back "
                    f"(default {DEFAULT_NAMESPACE_IDLE_S:g}; 0 = never)")
    ap.add_argument("--prefault", action="store_true",
                    help="back the pool's pages in this daemon, so they are charged to its "
                    "memory cgroup, not to the engines that map them (Kubernetes: request the "
                    "pool's memory on the daemon's container): the first namespace's before "
                    "the socket exists, at start-up; any other's when it opens")
    ap.add_argument("--back-ahead", metavar="SIZE",
                    help="back the pool's pages in this daemon as the pool fills, SIZE ahead "
                    "of the slots in use (e.g. 512MiB; the first SIZE before the socket "
                    "exists): charged here like --prefault, but the daemon holds only what "
                    "is stored plus SIZE, and starts at once; a write that outruns it backs "
                    "its own pages before the engine gets them. Not with --prefault")
    ap.add_argument("--metrics-host", default="127.0.0.1", help="Prometheus /metrics address")
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="Prometheus /metrics port (0 = any free port; default: off)")
    _peer_flags(ap)
    ap.add_argument("--log-level", default=None,
                    help="DEBUG, INFO, WARNING, ERROR (default from config: INFO)")
    return ap


def _access_flags(ap: argparse.ArgumentParser) -> None:
    """Who may attach, which namespaces they share, and what each may hold."""
    ap.add_argument("--allowed-uid", type=int, action="append", default=None,
                    help="uid allowed to attach (repeatable; default: this process's uid)")
    ap.add_argument("--tenant", action="append", default=[], metavar="NAME=UID[,UID...]",
                    help="share the namespaces of tenant NAME (the engines' tenant) between "
                    "these uids, and only them; every tenant not named (the empty one too: "
                    "--tenant =UID,UID shares it) is private to each uid (repeatable)")
    ap.add_argument("--uid-max-namespaces", type=int, default=16,
                    help="namespaces one uid may hold at once (default 16)")
    ap.add_argument("--uid-max-bytes", default=None,
                    help="pool bytes one uid's private namespaces may take, e.g. 8GiB "
                    "(default: an equal share for each allowed uid and named tenant)")
    ap.add_argument("--tenant-max-bytes", default=None,
                    help="pool bytes one named tenant's namespaces may take (default: the "
                    "same equal share)")
    ap.add_argument("--max-pending-per-uid", type=int, default=32,
                    help="connections of one uid that have not attached yet (default 32)")
    ap.add_argument("--max-clients", type=int, default=256,
                    help="attached clients at once (default 256)")
    ap.add_argument("--max-pending", type=int, default=128,
                    help="connections that have not attached yet, at once (default 128)")
    ap.add_argument("--handshake-timeout-s", type=float, default=2.0,
                    help="a connection must attach within this (default 2)")


def _peer_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--peer-listen", default="",
                    help="serve blocks to authenticated peers on HOST:PORT (default: off)")
    ap.add_argument("--peer", action="append", default=[],
                    help="tcp://HOST:PORT of a peer clients may ask this daemon to fetch from "
                    "(repeatable)")
    _pull_flags(ap)
    ap.add_argument("--peer-secret-file", help="file holding the shared peer secret")
    ap.add_argument("--peer-node-key", metavar="FILE",
                    help="this node's fleet key (kvcr fleet keygen): with --peer-fleet, peers "
                    "authenticate by node identity instead of a shared secret, and every block "
                    "carries its origin's signature")
    ap.add_argument("--peer-fleet", metavar="FILE",
                    help="the fleet file: trusted nodes, routers and revoked names (re-read "
                    "when it changes)")
    ap.add_argument("--peer-tls", nargs=3, metavar=("CERT", "KEY", "CA"),
                    help="TLS for the peer channel: this node's PEM certificate and key, and "
                    "the CA peers' certificates must chain to (mutual)")
    ap.add_argument("--peer-nixl", action="store_true",
                    help="move peer transfers to NIXL when both sides have it (install "
                    "'./packages/kvcr-core[nixl]' from this repository); NIXL exposes the pool "
                    "to authenticated peers for writes too, so use it only among trusted nodes "
                    "(docs/peers.md)")
    ap.add_argument("--peer-secret-env", default=DEFAULT_SECRET_ENV,
                    help=f"environment variable holding the secret (default {DEFAULT_SECRET_ENV})")


def _pull_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--no-pull-on-miss", dest="pull_on_miss", action="store_false",
                    help="do not follow the --peer inventories to fetch on a local miss "
                    "(default: follow them)")
    ap.add_argument("--pull-min-blocks", type=int, default=PeerConfig.pull_min_blocks,
                    help="pull on miss only runs of at least this many blocks "
                    f"(default {PeerConfig.pull_min_blocks})")
    ap.add_argument("--peer-feed-max-blocks", type=int, default=PeerConfig.feed_max_blocks,
                    help="blocks remembered per followed peer, about 180 bytes each "
                    f"(default {PeerConfig.feed_max_blocks})")


def config_from_args(args: argparse.Namespace) -> GuardConfig:
    overrides: dict[str, Any] = {}
    if args.pool_bytes is not None:
        overrides["pool_bytes"] = args.pool_bytes
    if args.namespace_pool_bytes is not None:
        overrides["namespace_pool_bytes"] = args.namespace_pool_bytes
    if args.log_level is not None:
        overrides["log_level"] = args.log_level
    runner = load_config(args.config, overrides=overrides)
    if runner.namespace_pool_bytes is None:  # never one namespace for the whole pool
        share = max(4096, runner.pool_bytes // DEFAULT_NAMESPACE_SHARE)
        runner = dataclasses.replace(runner, namespace_pool_bytes=share)
    secret = (secret_from(args.peer_secret_file, args.peer_secret_env,
                          node_key=args.peer_node_key, fleet=args.peer_fleet)
              if args.peer_listen or args.peer else None)
    peer = PeerConfig(listen=args.peer_listen, secret=secret, peers=frozenset(args.peer),
                      tls=PeerTLS(*args.peer_tls) if args.peer_tls else None,
                      nixl=args.peer_nixl, pull_on_miss=args.pull_on_miss,
                      pull_min_blocks=args.pull_min_blocks,
                      feed_max_blocks=args.peer_feed_max_blocks)
    extra: dict[str, Any] = {}
    if args.allowed_uid:
        extra["allowed_uids"] = frozenset(args.allowed_uid)
    limits = ClientLimits(held_fraction=args.client_held_fraction, ops=args.client_max_ops)
    server = ServerConfig(
        socket_path=args.socket, runner=runner, peer=peer, tenants=_tenants(args.tenant),
        uid_max_namespaces=args.uid_max_namespaces, max_clients=args.max_clients,
        max_pending=args.max_pending, handshake_timeout_s=args.handshake_timeout_s,
        max_pending_per_uid=args.max_pending_per_uid,
        uid_max_bytes=_size("--uid-max-bytes", args.uid_max_bytes),
        tenant_max_bytes=_size("--tenant-max-bytes", args.tenant_max_bytes),
        limits=limits, namespace_idle_s=args.namespace_idle_s or None, prefault=args.prefault,
        back_ahead_bytes=(parse_size_bytes("--back-ahead", args.back_ahead)
                          if args.back_ahead is not None else 0),
        **extra)
    return GuardConfig(server=server, metrics_host=args.metrics_host,
                       metrics_port=args.metrics_port)


def _size(flag: str, value: str | None) -> int | None:
    return None if value is None else parse_size_bytes(flag, value)


def _tenants(flags: list[str]) -> dict[str, frozenset[int]]:
    """--tenant NAME=UID[,UID...] flags -> tenant name -> uids."""
    tenants: dict[str, frozenset[int]] = {}
    for flag in flags:
        name, sep, uids = flag.partition("=")
        try:
            parsed = frozenset(int(u) for u in uids.split(",")) if sep and uids else None
        except ValueError:
            parsed = None
        if parsed is None:
            raise ConfigError("tenant", flag, "give NAME=UID[,UID...], e.g. --tenant team-a=1001")
        tenants[name] = tenants.get(name, frozenset()) | parsed
    return tenants


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
