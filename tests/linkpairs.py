"""Two ends of a link for the linkf tests: socketpair and loopback TCP pairs, the node's
HELLO_ACK_F they answer with, and a wait for a message."""

import socket
import time

from polling import TIMEOUT, background

from linkf import Endpoint
from proto.handshake import CapacitySummary, HelloAckF, LinkFLimits


def unix_pair() -> tuple[Endpoint, Endpoint]:
    a, b = socket.socketpair()
    return Endpoint.from_unix(a), Endpoint.from_unix(b)


def tcp_pair() -> tuple[Endpoint, Endpoint]:
    """(head, node) over loopback TCP."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(TIMEOUT)
        accepted = background(lambda: listener.accept()[0])
        head = Endpoint.connect_tcp(listener.getsockname(), TIMEOUT)
        node = Endpoint.from_tcp(accepted())
    return head, node


def ackf(identity="node"):
    return HelloAckF(
        chosen_version=0,
        node_identity=identity,
        capacity=CapacitySummary(max_context_tokens=4096),
        loadable_models=["mock"],
        limits=LinkFLimits(max_frame=16 << 20, transfer_window=8, max_transfer=1 << 26, transfer_budget=1 << 28),
    )


def messages_until(ep, wanted, seconds=TIMEOUT):
    """Pumps ``ep`` until a message of type ``wanted`` arrives; every message seen, in order."""
    deadline = time.monotonic() + seconds
    seen = []
    while time.monotonic() < deadline:
        seen += ep.pump()
        if any(m.msg_type == wanted for m in seen):
            return seen
    raise AssertionError(f"no 0x{wanted:04x} within {seconds} s; saw {[hex(m.msg_type) for m in seen]}")
