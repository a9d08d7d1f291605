"""`Endpoint`: a plain TCP endpoint, `tcp://HOST:PORT`, as KV hints, peer lists and router
configs name one. Owns the grammar and the canonical form (`str()`): a host name, an IPv4
address or a bracketed IPv6 address (compressed), port 1-65535, at most 255 characters; names
that resolvers would read as IPv4 ("0x7f.1") are refused. Pure; values are frozen.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
from collections.abc import Callable

from kvcr_core.errors import HintRejected, HintRejectReason

MAX_ENDPOINT_CHARS = 255
_ENDPOINT_RE = re.compile(
    r"tcp://(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]{1,253})):(?P<port>[0-9]{1,5})")
_LABEL_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def _shown(value: object) -> str:
    if isinstance(value, str):
        return repr(value) if len(value) <= 60 else f"{value[:57]!r}... ({len(value)} chars)"
    return repr(value) if value is None or isinstance(value, int | float) else \
        f"a {type(value).__name__}"


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """A plain TCP endpoint. `str()` is the canonical `tcp://host:port`."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @classmethod
    def parse(cls, text: object, where: str = "source_control_endpoint", *,
              describe: Callable[[object], str] = _shown) -> Endpoint:
        """Parse `tcp://HOST:PORT`; anything else is HintRejected(BAD_ENDPOINT), naming
        `where` and the value as `describe` renders it."""
        host: str | None = None
        port = 0
        if isinstance(text, str) and len(text) <= MAX_ENDPOINT_CHARS:
            match = _ENDPOINT_RE.fullmatch(text)
            port = int(match["port"]) if match else 0
            if match and 1 <= port <= 65535:
                host = _canonical_host(match["v6"], match["name"])
        if host is None:
            raise HintRejected(
                HintRejectReason.BAD_ENDPOINT,
                f"{where} is {describe(text)}: send 'tcp://HOST:PORT' (a hostname, IPv4 or "
                f"[IPv6] address; port 1-65535; at most {MAX_ENDPOINT_CHARS} chars)")
        return cls(host, port)


def _canonical_host(ipv6: str | None, name: str) -> str | None:
    try:
        if ipv6:
            return ipaddress.IPv6Address(ipv6).compressed
        if name.rpartition(".")[2].isdigit():
            return str(ipaddress.IPv4Address(name))
        if not all(_LABEL_RE.fullmatch(label) for label in name.split(".")):
            return None
        socket.inet_aton(name)  # resolvers read names like "0x7f.1" as IPv4: refuse them
    except ValueError:
        return None
    except OSError:  # inet_aton refused it: a plain host name
        return name
    return None
