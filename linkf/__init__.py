"""The Link F session layer: pure state machines for both ends (``agent``, ``head``) and the
framed endpoint that runs them over a socket (``driver``, ``secure``) and hands back what it
receives as ``Message``s (``message``)."""

from .agent import AgentAction, AgentSession, SelfFence
from .driver import DEFAULT_LIVENESS, PROTO_VERSION, SUPPORTED_VERSIONS, Endpoint, Liveness
from .errors import Closed, Envelope, Io, LinkFError, Payload, Protocol, TimedOut, Unauthorized
from .head import HeadSession
from .message import Message
from .secure import NoiseRole

__all__ = [
    "AgentAction",
    "AgentSession",
    "Closed",
    "DEFAULT_LIVENESS",
    "Endpoint",
    "Envelope",
    "HeadSession",
    "Io",
    "LinkFError",
    "Liveness",
    "Message",
    "NoiseRole",
    "PROTO_VERSION",
    "Payload",
    "Protocol",
    "SUPPORTED_VERSIONS",
    "SelfFence",
    "TimedOut",
    "Unauthorized",
]
