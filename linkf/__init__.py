"""The Link F session layer: pure state machines for both ends (``agent``, ``head``) and the
framed endpoint that runs them over a socket (``driver``, ``secure``)."""

from .agent import AgentAction, AgentSession
from .driver import PROTO_VERSION, SUPPORTED_VERSIONS, Endpoint, Liveness
from .errors import Closed, Envelope, Io, LinkFError, Payload, Protocol, TimedOut, Unauthorized
from .head import HeadSession
from .secure import NoiseRole

__all__ = [
    "AgentAction",
    "AgentSession",
    "Closed",
    "Endpoint",
    "Envelope",
    "HeadSession",
    "Io",
    "LinkFError",
    "Liveness",
    "NoiseRole",
    "PROTO_VERSION",
    "Payload",
    "Protocol",
    "SUPPORTED_VERSIONS",
    "TimedOut",
    "Unauthorized",
]
