"""`ServerConfig`: what an attach server needs (the socket, the Runner's config, who may attach
and open which namespaces, per-client bounds, the peer settings), frozen and validated once.
kvcr-guard builds it from its flags; embedded mode from the engine's settings.
The pool must be memfd memory (engines map it by descriptor): `memory_backing: anonymous` is
a ConfigError here, at start, rather than a failure of every attach.

The socket's directory (and each one above it that is not sticky) must be writable by no uid
but this one and root: otherwise another uid could bind the path first and capture engines.

Access policy: a client connects only with a uid in `allowed_uids`; a tenant named in
`tenants` is shared by the uids it names (refused to others), any other tenant is private to
each uid (kvcr_core.attach.admission); one uid holds at most `uid_max_namespaces` namespaces
and `uid_max_bytes` of pool at once, a named tenant `tenant_max_bytes`. Pre-attach bounds: at most
`max_pending` connections that have not said Hello yet (one more closes the one that waited
longest: an engine says Hello at once, an idle flood cannot keep it out), each for at most
`handshake_timeout_s`; attached clients are counted apart (`max_clients`), so unattached ones
can never crowd them out.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from kvcr_core.attach.credentials import shared_directory_problem
from kvcr_core.attach.service import ClientLimits
from kvcr_core.attach.settings import PeerConfig
from kvcr_core.config import KVCRConfig, MemoryBacking
from kvcr_core.errors import ConfigError

MAX_SOCKET_PATH_BYTES = 107
PRIVATE_SCOPE = "@uid:"  # tenant suffix of a uid's private namespaces (attach.admission)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    socket_path: str
    runner: KVCRConfig = dataclasses.field(default_factory=KVCRConfig)
    allowed_uids: frozenset[int] = dataclasses.field(
        default_factory=lambda: frozenset({os.getuid()}))
    tenants: Mapping[str, frozenset[int]] = dataclasses.field(default_factory=dict)
    """Tenant name -> the uids that may open its namespaces (tenants not named: any uid)."""
    uid_max_namespaces: int = 16
    uid_max_bytes: int | None = None
    """Pool bytes the namespaces private to one uid may take together (None: an equal share
    of the pool for each allowed uid and named tenant)."""
    tenant_max_bytes: int | None = None
    """The same for the namespaces of one named tenant."""
    max_pending_per_uid: int = 32
    """Connections of one uid that have not said Hello yet (one more closes that uid's
    oldest): a uid flooding the socket evicts only its own connections."""
    max_clients: int = 256
    max_pending: int = 128
    handshake_timeout_s: float = 2.0
    limits: ClientLimits = dataclasses.field(default_factory=ClientLimits)
    namespace_idle_s: float | None = None
    """A namespace no client has used for this long gives its memory back (None: never)."""
    prefault: bool = False
    """Back every page of a namespace's pool when it opens, before the client that opened it
    gets its fd: the pages are then charged to this process's memory cgroup, never to the
    engines that map them (what a Kubernetes memory request on the daemon needs). The first
    Hello of a namespace waits for it, and so does the server's loop."""
    back_ahead_bytes: int = 0
    """Back a namespace's pool pages here as it fills, this many bytes ahead of the slots in
    use (0: off): charged to this process like `prefault`, but only what is stored (plus the
    margin) is held; a reservation that outruns the margin backs its own pages before the
    engine gets them. Exclusive with `prefault`."""
    peer: PeerConfig = dataclasses.field(default_factory=PeerConfig)

    @property
    def abstract(self) -> bool:
        """A Linux abstract socket ("\\0name"): no file, gone with the process (the uid check
        is then the only gate, as there are no file permissions)."""
        return self.socket_path.startswith("\0")

    def __post_init__(self) -> None:
        if not self.socket_path:
            raise ConfigError("socket", self.socket_path, "give the Unix socket path to serve")
        if self.runner.memory_backing is not MemoryBacking.MEMFD:
            raise ConfigError("memory_backing", self.runner.memory_backing.value,
                              "engines attach to this pool by its file descriptor: use memfd "
                              "(anonymous memory suits only a Runner used in one process)")
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH_BYTES:
            raise ConfigError("socket", self.socket_path,
                              f"Unix socket paths must be under {MAX_SOCKET_PATH_BYTES} bytes; "
                              "use a shorter directory such as /run/kvcr")
        parent = os.path.dirname(os.path.abspath(self.socket_path))
        if not self.abstract and not os.path.isdir(parent):
            raise ConfigError("socket", self.socket_path, f"create the directory {parent} first")
        problem = None if self.abstract else shared_directory_problem(parent)
        if problem is not None:
            raise ConfigError("socket", self.socket_path,
                              f"{problem}: another uid could bind this socket first and serve "
                              "your engines; use a directory only this uid (or root) can write, "
                              "e.g. mkdir -m 0755 /run/kvcr")
        if self.back_ahead_bytes < 0:
            raise ConfigError("back_ahead", self.back_ahead_bytes,
                              "give a size such as 512MiB (0: off)")
        if self.back_ahead_bytes and self.prefault:
            raise ConfigError("back_ahead", self.back_ahead_bytes,
                              "--prefault backs the whole pool already: give one of the two")
        if not self.allowed_uids or any(u < 0 for u in self.allowed_uids):
            raise ConfigError("allowed_uids", sorted(self.allowed_uids),
                              "give one or more non-negative uids")
        for tenant, uids in self.tenants.items():
            if not uids <= self.allowed_uids:
                raise ConfigError("tenants", f"{tenant}={sorted(uids)}",
                                  f"uids {sorted(uids - self.allowed_uids)} may not attach at "
                                  "all: allow them too (--allowed-uid)")
        for tenant in self.tenants:
            if PRIVATE_SCOPE in tenant or "\0" in tenant:
                raise ConfigError("tenants", tenant, f"a tenant name may not contain "
                                  f"{PRIVATE_SCOPE!r} (private namespaces use it) or NUL")
        for name in ("uid_max_bytes", "tenant_max_bytes"):
            value = getattr(self, name)
            if value is not None and value < 4096:
                raise ConfigError(name, value, "give a size of at least 4KiB, e.g. 8GiB")
        for name in ("max_clients", "max_pending", "max_pending_per_uid",
                     "uid_max_namespaces"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "give a positive count")
        if not 0 < self.handshake_timeout_s <= 60:
            raise ConfigError("handshake_timeout_s", self.handshake_timeout_s,
                              "give seconds in (0, 60]")
        limits = self.limits
        if not 0 < limits.held_fraction <= 1 or limits.ops < 1 or limits.tickets < 1:
            raise ConfigError("limits", limits, "give a held fraction in (0, 1] and positive "
                              "op and fetch counts")
        idle = self.namespace_idle_s
        if idle is not None and (not math.isfinite(idle) or idle <= 0):
            raise ConfigError("namespace_idle_s", idle, "give positive seconds (or none)")
        self.peer.check_secret()
