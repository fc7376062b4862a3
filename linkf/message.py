"""What an ``Endpoint`` hands back for each frame it receives: the frame, with its payload as the
catalog's message type, the receiving twin of ``Endpoint.send`` taking a message.

The payload is decoded on the first read of ``Message.msg``, not when the frame arrives. The
Rust agent decodes a payload only for the types it acts on and drops every other frame unread
(``_ => {}`` in the Rust node's ``handle``), so a TELEMETRY or POLICY_UPDATE whose payload does not
decode costs the peer nothing; decoding every frame in ``pump`` would turn that frame into a
``Payload`` error and end the link. Read lazily, a frame is decoded exactly when a caller needs
it, as before, and what fails to decode fails here, one way, for every caller. Types outside
the catalog never reach a ``Message``: the envelope decoder skips an unknown droppable type and
refuses an unknown required one (linkf-wire.md §1).

A ``Message`` is a ``Frame`` (its envelope fields and raw ``payload``, as transcripts keep them),
built by the endpoint's ``FrameDecoder`` in place of one: ``pump`` is on every connection's hot
path, and a wrapper around each frame cost a second object per frame.
"""

from __future__ import annotations

from typing import Any

from proto.envelope import Frame
from proto.linkf import decode_payload, type_name
from proto.postcard import PostcardError

from .errors import Payload

#: `Message._msg` until the payload has been decoded (None is a payload's value too).
_UNREAD: Any = object()


class Message(Frame):
    """A received frame and ``msg``, its payload decoded as the class the catalog gives its
    ``msg_type`` (a ``TokenEventsMsg``, a ``LeaseGrantMsg``, ...), decoded once."""

    #: Who sent it, named by the error a payload that does not decode raises; the endpoint
    #: sets it on each message it hands back.
    peer: str | None = None
    _msg: Any = _UNREAD

    @property
    def msg(self) -> Any:
        """The payload decoded; ``Payload`` when it does not decode as its type."""
        msg = self._msg
        if msg is _UNREAD:
            t = self.msg_type
            try:
                msg = self._msg = decode_payload(t, self.payload)
            except PostcardError as e:
                raise Payload(f"{type_name(t)} (0x{t:04x}): {e}", peer=self.peer) from e
        return msg
