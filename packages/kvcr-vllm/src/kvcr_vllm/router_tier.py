"""Dynamo's KV-hint capability as a vLLM worker advertises it: owns the validation of
`kv_connector_extra_config.secondary_tiers` and of the hint hash scheme.

NVIDIA Dynamo reads `secondary_tiers` from the connector's extra config: a worker whose one
entry lists `"router_capabilities": ["router_hint"]` with `control_ports` (one per local DP
rank) and `control_advertise_host` gets `kv.fetch` hints naming another worker's
`tcp://control_advertise_host:control_ports[rank]`. For kvcr that endpoint must be where peers
fetch blocks from: the embedded Runner's `peer_listen` (checked here), or (guarded mode)
kvcr-guard's `--peer-listen` (`guard_endpoint_problem`: the connector asks the guard at start
and warns; docs/dynamo.md).

`hint_hash_scheme` names what a hint's `block_hashes` are: `kvcr-v1` (kvcr's router hashes,
docs/keys.md; the default) or `vllm-engine` (vLLM's own prefix-cache block hashes, root
aligned, as Dynamo sends them; the default when a router-hint tier is configured).

Pure; thread-safe (frozen values).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import logging
from collections.abc import Mapping
from typing import Any

from kvcr_core.attach import Mode, PeerConfig
from kvcr_core.endpoint import Endpoint
from kvcr_core.errors import ConfigError, HintRejected

ROUTER_HINT = "router_hint"
TIER_KEYS = frozenset({"router_capabilities", "control_ports", "control_advertise_host"})
_MAX_CONTROL_PORTS = 64

log = logging.getLogger("kvcr_vllm")


class HintHashScheme(enum.Enum):
    """What the `block_hashes` of a hint's fetch action are."""

    KVCR_V1 = "kvcr-v1"  # kvcr's router hashes of kvcr block keys (kvcr-router)
    VLLM_ENGINE = "vllm-engine"  # vLLM's prefix-cache block hashes, u64, hash i = block i


@dataclasses.dataclass(frozen=True)
class RouterHintTier:
    """The one `secondary_tiers` entry that offers Dynamo's `router_hint` capability."""

    control_ports: tuple[int, ...]
    """The control (peer) port of each local DP rank, in rank order."""
    advertise_host: str
    """The host peers dial (never an unspecified address)."""

    def endpoint(self, dp_rank: int) -> str:
        """The `tcp://host:port` Dynamo names when this worker's DP rank is the source."""
        return str(Endpoint(self.advertise_host, self.control_ports[dp_rank]))


def parse_secondary_tiers(raw: object, field: str) -> RouterHintTier | None:
    """The router-hint tier of `secondary_tiers` (None: no entry offers `router_hint`).
    Raises ConfigError naming the entry and the fix; unknown keys of an entry are kept
    for future Dynamo versions and logged."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ConfigError(field, raw, 'give a list of tiers, e.g. [{"router_capabilities": '
                          '["router_hint"], "control_ports": [7500], '
                          '"control_advertise_host": "10.0.0.7"}]')
    tiers = []
    for index, entry in enumerate(raw):
        where = f"{field}[{index}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(where, entry, "give a mapping with router_capabilities, "
                              "control_ports and control_advertise_host")
        unknown = sorted(set(entry) - TIER_KEYS)
        if unknown:
            log.warning("kvcr: %s has keys kvcr does not use (%s); ignoring them (kvcr reads "
                        "%s)", where, ", ".join(map(str, unknown)), ", ".join(sorted(TIER_KEYS)))
        capabilities = entry.get("router_capabilities", [])
        if not isinstance(capabilities, list) or not all(isinstance(c, str)
                                                         for c in capabilities):
            raise ConfigError(f"{where}.router_capabilities", capabilities,
                              f'give a list of strings, e.g. ["{ROUTER_HINT}"]')
        if ROUTER_HINT in capabilities:
            tiers.append(_router_hint_tier(entry, where))
    if len(tiers) > 1:
        raise ConfigError(field, raw, f"give exactly one entry with {ROUTER_HINT!r}: a kv.fetch "
                          "hint names one source endpoint per worker")
    return tiers[0] if tiers else None


def _router_hint_tier(entry: Mapping[str, Any], where: str) -> RouterHintTier:
    ports = entry.get("control_ports")
    if not isinstance(ports, list) or not 1 <= len(ports) <= _MAX_CONTROL_PORTS or not all(
            type(p) is int and 1 <= p <= 65535 for p in ports):
        raise ConfigError(f"{where}.control_ports", ports, "give a list with one port "
                          "(1-65535) per local DP rank: the kvcr peer port of that rank")
    host = entry.get("control_advertise_host")
    fix = ("give the host or IP address other workers reach this node's kvcr peer endpoint "
           "at (not 0.0.0.0 or ::)")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"{where}.control_advertise_host", host, fix)
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        unspecified = ipaddress.ip_address(bare).is_unspecified
    except ValueError:
        unspecified = False  # a host name
    if unspecified:
        raise ConfigError(f"{where}.control_advertise_host", host, fix)
    try:
        endpoint = Endpoint.parse(str(Endpoint(bare, ports[0])), f"{where}.control_advertise_host")
    except HintRejected:
        raise ConfigError(f"{where}.control_advertise_host", host, fix) from None
    return RouterHintTier(tuple(ports), endpoint.host)


def check_control_endpoint(tier: RouterHintTier, mode: Mode, peer: PeerConfig, dp_rank: int,
                           field: str) -> None:
    """The advertised control endpoint of `dp_rank` must be the one peers fetch from."""
    where = f"{field}.control_ports"
    if not 0 <= dp_rank < len(tier.control_ports):
        raise ConfigError(where, list(tier.control_ports), f"give one port per local DP rank "
                          f"(this engine is local DP rank {dp_rank})")
    if mode is Mode.GUARDED:
        return  # kvcr-guard's --peer-listen: the operator keeps the two in step
    port = tier.control_ports[dp_rank]
    listen_host, _, listen_port = peer.listen.rpartition(":")
    if not listen_port or int(listen_port) != port:
        raise ConfigError(where, list(tier.control_ports),
                          f"Dynamo advertises port {port} as this worker's kvcr source, but "
                          f"peer_listen is {peer.listen!r}: set peer_listen to "
                          f"\"0.0.0.0:{port}\" (a fixed port, the one in control_ports)")
    bound, advertised = _ip(listen_host), _ip(tier.advertise_host)
    if bound is not None and advertised is not None and not bound.is_unspecified \
            and bound != advertised:
        raise ConfigError(f"{field}.control_advertise_host", tier.advertise_host,
                          f"peers would dial {tier.endpoint(dp_rank)}, but peer_listen binds "
                          f"only {peer.listen}: advertise {listen_host} or listen on "
                          f"0.0.0.0:{port}")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None  # a host name: it may resolve to the bound address


def parse_hash_scheme(raw: object, tier: RouterHintTier | None, field: str) -> HintHashScheme:
    """`hint_hash_scheme`; absent: `vllm-engine` with a router-hint tier, else `kvcr-v1`."""
    if raw is None:
        return HintHashScheme.KVCR_V1 if tier is None else HintHashScheme.VLLM_ENGINE
    try:
        return HintHashScheme(raw)
    except ValueError:
        raise ConfigError(field, raw, "use 'kvcr-v1' (kvcr-router's hashes) or "
                          "'vllm-engine' (vLLM's block hashes, as Dynamo sends them)") from None


def guard_endpoint_problem(tier: RouterHintTier, dp_rank: int, status: Mapping[str, Any]
                           ) -> str | None:
    """Guarded mode: why the advertised control port is not where kvcr-guard (its `status`,
    `kvcr status` fields) serves peers, with the fix; None when it is."""
    port = tier.control_ports[dp_rank]
    served = status.get("peer_endpoint")
    if not isinstance(served, str) or not served:
        return (f"kvcr-guard serves no peers, yet Dynamo advertises port {port} as this "
                f"worker's kvcr source: start kvcr-guard with --peer-listen HOST:{port}")
    if served.rpartition(":")[2] != str(port):
        return (f"kvcr-guard serves peers on {served}, yet Dynamo advertises port {port} as this "
                "worker's kvcr source: make control_ports the guard's --peer-listen port")
    return None
