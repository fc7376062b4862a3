"""`superfluid-noded join HEAD:PORT`: the node dials the head instead of listening (the Rust
`superfluid node join`), for nodes behind NAT or a firewall that the head cannot reach.

Only the direction of the TCP connect changes: the head still opens the Noise handshake (the
node is the responder) and still says HELLO first, so every connection is served exactly as
an accepted one. The node keeps one connection per lane, each redialling on its own after a
drop: 2 s after the first failure, doubling to 30 s, back to 2 s once a HELLO is answered. A
head that refuses the token ends the process with exit 2, since redialling cannot fix that.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass

from linkf.driver import Endpoint, split_address
from linkf.errors import Closed, LinkFError, Unauthorized
from linkf.secure import NoiseRole
from nodeagent.logs import say
from nodeagent.noded import Node
from nodeagent.observe import Observers

log = logging.getLogger("nodeagent.join")

REDIAL_FIRST_S = 2.0
REDIAL_MAX_S = 30.0
#: How long one TCP connect to the head may take.
CONNECT_S = 5.0
#: Exit code and line for a head that refuses this node's token.
REFUSED_EXIT = 2
REFUSED = "the head refused this node's token; copy the head's `superfluid fleet token` here with --token"


@dataclass
class Backoff:
    """The wait before each redial: `first`, doubling up to `cap`, back to `first` on `reset`."""

    first: float = REDIAL_FIRST_S
    cap: float = REDIAL_MAX_S
    current: float = REDIAL_FIRST_S

    def next(self) -> float:
        wait = self.current
        self.current = min(self.current * 2, self.cap)
        return wait

    def reset(self) -> None:
        self.current = self.first


class Joiner:
    """The lanes' connections to one head, and what ends them all."""

    def __init__(self, node: Node, head: str, token: bytes, observer: Observers) -> None:
        self.node = node
        self.head = head
        self.token = token
        self.observer = observer
        self.exit_code: int | None = None
        self._over = threading.Event()

    def run(self, lanes: int) -> int:
        """Dials the head once per lane until a signal or a refused token; the exit code."""
        say(
            f"node '{self.node.identity}' serves {self.node.model_name}; dialing the head at "
            f"{self.head} once per lane ({lanes})"
        )
        for lane in range(lanes):
            threading.Thread(
                target=self._keep_dialing, args=(lane == 0,), name=f"node-lane {lane}", daemon=True
            ).start()
        while self.exit_code is None and not self.node.wait_for_stop(0.1):
            self.node.watch_engine()
        self._over.set()
        if self.exit_code is not None:
            say(REFUSED)
            self.node.daemon.close()
            return self.exit_code
        return self.node.drain()

    def _keep_dialing(self, speaks: bool) -> None:
        """One lane: dial, serve until the link ends, wait, dial again. The first lane speaks
        for the node in the log, as every lane sees the same head."""
        backoff = Backoff()
        while not self._over.is_set() and not self.node.stopping():
            self._serve_once(backoff, speaks)
            if self._over.is_set() or self.node.stopping():
                return
            wait = backoff.next()
            if speaks:
                say(f"dialing again in {wait:g} s")
            if self.node.wait_for_stop(wait):
                return

    def _serve_once(self, backoff: Backoff, speaks: bool) -> None:
        try:
            endpoint = self._dial()
        except Unauthorized:
            self._refused()
            return
        except (LinkFError, OSError) as e:
            if speaks:
                say(f"cannot join the head at {self.head}: {e}")
            return
        peer = endpoint.peer

        def joined() -> None:
            backoff.reset()
            self.observer.connection_opened(peer)
            if speaks:
                say(f"joined the head at {self.head}")

        error: BaseException | None = None
        try:
            self.node.agent.connection().serve(endpoint, on_hello=joined)
        except Unauthorized as e:
            error = e
            self._refused()
        except Exception as e:  # noqa: BLE001 - a lane's link ending is news, never fatal
            error = e
            if speaks:
                say("the head closed the link" if isinstance(e, Closed) else f"the link to the head ended: {e}")
            log.debug("the link's traceback", exc_info=True)
        finally:
            self.observer.ended(peer, error)

    def _dial(self) -> Endpoint:
        sock = socket.create_connection(split_address(self.head), CONNECT_S)
        sock.settimeout(None)
        if not self.token:
            return Endpoint.from_tcp(sock)
        return Endpoint.from_tcp_secure(sock, self.token, NoiseRole.Responder, self.node.handshake_s)

    def _refused(self) -> None:
        self.exit_code = REFUSED_EXIT
        self._over.set()
