"""What engines need to talk to kvcr-guard: the attach protocol and the client.

Lives in core because both sides need it; connectors never import kvcr_guard.
"""

from kvcr_core.guard_client.client import GuardClient, GuardUnavailable
from kvcr_core.guard_client.protocol import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "GuardClient", "GuardUnavailable"]
