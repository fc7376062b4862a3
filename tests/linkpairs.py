"""Two ends of a link for the linkf tests: socketpair and loopback TCP pairs."""

import socket

from polling import TIMEOUT, background

from linkf import Endpoint


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
