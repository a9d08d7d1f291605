"""`Admission`: who may open which namespaces of a Runner now, and which namespace each
request really opens. Tenancy is deny by default:

- a tenant named in `tenants` (`--tenant NAME=UID,UID`) is shared by the uids it names and
  refused to every other uid; its namespaces keep the digest the engines compute;
- any other tenant (the empty one included) is private to each uid: uid U's request opens
  the namespace of tenant `T@uid:U`, which no other uid can name. The Runner's own uid is
  the exception: its namespaces keep their digest (it owns the memory anyway), so an
  embedded Runner, or a kvcr-guard run as the engines' uid, is what routers and peers see.

A client opens a set of namespaces only if fewer than `max_clients` clients are attached and
its uid would hold at most `uid_max_namespaces` distinct namespaces with them. Refusals name
the flag that changes them. Pure policy over what the caller passes; thread-safe.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

from kvcr_core.attach.config import PRIVATE_SCOPE, ServerConfig
from kvcr_core.attach.protocol import CloseReason
from kvcr_core.keys import NamespaceSpec
from kvcr_core.logs import printable
from kvcr_core.types import NamespaceDigest


class AttachRefused(Exception):
    """A client may not attach (or its namespaces cannot open): the connection closes with
    `reason`, told in a Goodbye."""

    def __init__(self, reason: CloseReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


def private_spec(spec: NamespaceSpec, uid: int) -> NamespaceSpec:
    """The namespace uid `uid` opens for `spec` when its tenant is not shared."""
    return dataclasses.replace(spec, tenant=f"{spec.tenant}{PRIVATE_SCOPE}{uid}")


@dataclasses.dataclass(frozen=True)
class Scope:
    """Whose a namespace is: one uid's (private) or a named tenant's. `uids` may open it and
    see it in the status; its namespaces together take at most `max_bytes` of the pool."""

    name: str  # "uid:1001" or "tenant:team-a"
    uids: frozenset[int]
    max_bytes: int
    shared: bool  # a named tenant: other uids may open its namespaces too


class Admission:
    def __init__(self, config: ServerConfig, *, runner_uid: int | None = None) -> None:
        """`runner_uid`: the uid the Runner runs as (default: this process's)."""
        self.config = config
        self.runner_uid = os.getuid() if runner_uid is None else runner_uid
        scopes = len(config.allowed_uids | {self.runner_uid}) + len(config.tenants)
        self.default_max_bytes = config.runner.pool_bytes // max(1, scopes)

    def scope(self, uid: int, tenant: str) -> Scope:
        """The scope `uid` opens a namespace of `tenant` in (it may, or check refused)."""
        config = self.config
        allowed = config.tenants.get(tenant)
        if allowed is not None:
            return Scope(f"tenant:{printable(tenant)}", allowed,
                         config.tenant_max_bytes or self.default_max_bytes, True)
        return Scope(f"uid:{uid}", frozenset({uid}),
                     config.uid_max_bytes or self.default_max_bytes, False)

    def check(self, uid: int, specs: Sequence[NamespaceSpec],
              attached: Iterable[tuple[int, Iterable[NamespaceDigest]]]
              ) -> list[NamespaceSpec]:
        """The namespaces `uid` opens for `specs` (see the module's doc), or AttachRefused
        unless it may open them now; `attached`: (uid, the namespaces it opened) of each
        attached client."""
        config = self.config
        clients = list(attached)
        if len(clients) >= config.max_clients:
            raise AttachRefused(CloseReason.TOO_MANY_CLIENTS,
                                f"{config.max_clients} clients attached already")
        opened = []
        for spec in specs:
            allowed = config.tenants.get(spec.tenant)
            if allowed is None:
                opened.append(spec if uid == self.runner_uid else private_spec(spec, uid))
                continue
            if uid not in allowed:
                raise AttachRefused(CloseReason.NOT_ALLOWED,
                                    f"uid {uid} may not open namespaces of tenant "
                                    f"{printable(spec.tenant)!r} (kvcr-guard --tenant)")
            opened.append(spec)
        mine = {d for owner_uid, digests in clients if owner_uid == uid for d in digests}
        wanted = mine | {spec.digest() for spec in opened}
        if len(wanted) > len(mine) and len(wanted) > config.uid_max_namespaces:
            raise AttachRefused(CloseReason.QUOTA,
                                f"uid {uid} holds {len(mine)} namespaces; {len(wanted)} is more "
                                "than it may (kvcr-guard --uid-max-namespaces)")
        return opened
