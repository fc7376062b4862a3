"""The ways a Link F link fails.

Every failure is a ``LinkFError``; each of the Rust enum's variants is a subclass of it, one
class per kind, imported by name (``except TimedOut``). Messages name the peer when the
endpoint knows its address, since they end up in the node's log lines.
"""

from __future__ import annotations


class LinkFError(Exception):
    """Base of every Link F failure. ``detail`` says what happened, ``peer`` to whom."""

    summary = "link failure"

    def __init__(self, detail: str = "", *, peer: str | None = None) -> None:
        self.detail = detail
        self.peer = peer
        super().__init__(self._message())

    def _message(self) -> str:
        text = f"{self.summary}: {self.detail}" if self.detail else self.summary
        return f"{text} (peer {self.peer})" if self.peer else text


class Io(LinkFError):
    """The socket failed; the ``OSError`` is the ``__cause__``."""

    summary = "io"


class Envelope(LinkFError):
    """The byte stream is not a valid sequence of frames."""

    summary = "envelope"


class Payload(LinkFError):
    """A frame's payload does not decode as its message type."""

    summary = "payload decode"


class Protocol(LinkFError):
    """The peer broke the protocol; ``reason`` is a fixed phrase a caller may match on."""

    summary = "protocol violation"

    def __init__(self, reason: str, *, peer: str | None = None) -> None:
        self.reason = reason
        super().__init__(reason, peer=peer)


class Closed(LinkFError):
    summary = "peer closed the connection"


class TimedOut(LinkFError):
    summary = "timed out waiting for the peer"


class Unauthorized(LinkFError):
    summary = "peer failed authentication"


__all__ = ["LinkFError", "Io", "Envelope", "Payload", "Protocol", "Closed", "TimedOut", "Unauthorized"]
