"""Two ends of a link for the linkf tests: a thread runner, socketpair and loopback TCP pairs."""

import socket
import threading

from linkf import Endpoint

TIMEOUT = 5.0


def run(fn):
    """Runs `fn` on a thread; the returned `result()` joins it and re-raises what it raised, so
    a side that hangs fails the test instead of stalling it."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test thread
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()

    def result():
        t.join(TIMEOUT)
        assert not t.is_alive(), "the other side hung"
        if "error" in out:
            raise out["error"]
        return out["value"]

    return result


def unix_pair() -> tuple[Endpoint, Endpoint]:
    a, b = socket.socketpair()
    return Endpoint.from_unix(a), Endpoint.from_unix(b)


def tcp_pair() -> tuple[Endpoint, Endpoint]:
    """(head, node) over loopback TCP."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(TIMEOUT)
        accepted = run(lambda: listener.accept()[0])
        head = Endpoint.connect_tcp(listener.getsockname(), TIMEOUT)
        node = Endpoint.from_tcp(accepted())
    return head, node
