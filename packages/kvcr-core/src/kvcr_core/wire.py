"""What the attach protocol and the peer protocol share on the wire: the message base (tagged
msgpack arrays in length-prefixed frames, kvcr_core.framing), the encoder, and the messages
both protocols carry in the same shape (`PostHint`).

A message's tag names its type; its fields travel as an array (compact, fast to decode).
Statuses and reasons are enums (sent as their string values), so a decoder rejects a value
it does not know instead of passing an arbitrary string on. Pure; thread-safe.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from kvcr_core.framing import frame

MAX_HINT_ENVELOPE_BYTES: Final = 1 << 20


class Message(msgspec.Struct, tag=True, array_like=True):
    """Base of every kvcr wire message."""


class PostHint(Message, tag="post_hint"):
    """A KV hint for requests still to come on a Runner's engines (a router's push, over the
    peer protocol, or an engine's, over the attach protocol); answered with how many block
    hashes the Runner remembered (0: rejected, and counted in kvcr_hints_total)."""

    envelope: Annotated[str, msgspec.Meta(max_length=MAX_HINT_ENVELOPE_BYTES)]


_encoder = msgspec.msgpack.Encoder()


def encode_frame(message: Message) -> bytes:
    """One framed message."""
    return frame(_encoder.encode(message))
