"""Optional TLS for the peer channel (on top of the shared-secret handshake, which still runs):
server and client contexts from PEM files, mutual when a CA is given. Pure; thread-safe."""

from __future__ import annotations

import dataclasses
import ssl

from kvcr_core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PeerTLS:
    cert_file: str
    key_file: str
    ca_file: str  # peers' certificates must chain to it (both directions)

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load(ctx)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load(ctx)
        return ctx

    def _load(self, ctx: ssl.SSLContext) -> None:
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
            ctx.load_verify_locations(self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("peer_tls", f"{self.cert_file}, {self.key_file}, {self.ca_file}",
                              f"cannot load the certificate, key or CA ({exc})") from None
