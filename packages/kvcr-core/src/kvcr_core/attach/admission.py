"""`Admission`: who may open which namespaces of a Runner now. A client opens a set of
namespaces only if fewer than `max_clients` clients are attached, the set's tenants name its
uid (a tenant not named in `tenants` is open to every allowed uid), and its uid would hold at
most `uid_max_namespaces` distinct namespaces with them. Refusals name the flag that changes
them. Pure policy over what the caller passes; thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcr_core.attach.config import ServerConfig
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


class Admission:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    def check(self, uid: int, specs: Sequence[NamespaceSpec],
              attached: Iterable[tuple[int, Iterable[NamespaceDigest]]]) -> None:
        """Raises AttachRefused unless `uid` may open `specs` now; `attached`: (uid, the
        namespaces it opened) of each attached client."""
        config = self.config
        clients = list(attached)
        if len(clients) >= config.max_clients:
            raise AttachRefused(CloseReason.TOO_MANY_CLIENTS,
                                f"{config.max_clients} clients attached already")
        for spec in specs:
            allowed = config.tenants.get(spec.tenant)
            if allowed is not None and uid not in allowed:
                raise AttachRefused(CloseReason.NOT_ALLOWED,
                                    f"uid {uid} may not open namespaces of tenant "
                                    f"{printable(spec.tenant)!r} (kvcr-guard --tenant)")
        mine = {d for owner_uid, digests in clients if owner_uid == uid for d in digests}
        wanted = mine | {spec.digest() for spec in specs}
        if len(wanted) > len(mine) and len(wanted) > config.uid_max_namespaces:
            raise AttachRefused(CloseReason.QUOTA,
                                f"uid {uid} holds {len(mine)} namespaces; {len(wanted)} is more "
                                "than it may (kvcr-guard --uid-max-namespaces)")
