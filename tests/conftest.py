"""Shared fixtures: a node agent served on an ephemeral loopback port, one thread per
connection, as `superfluid-noded` serves it; stopped and joined after each test."""

from __future__ import annotations

import queue
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from linkf.driver import Endpoint  # noqa: E402
from linkf.secure import NoiseRole  # noqa: E402
from nodeagent.agent import NodeAgent  # noqa: E402
from nodeagent.daemon import Daemon  # noqa: E402
from nodeagent.engine.mock import MockDaemon  # noqa: E402

JOIN_TIMEOUT = 5.0


@dataclass
class ServedNode:
    """A node listening on `addr`; `outcomes` gets, per connection that ended, None or the
    exception its `serve` raised."""

    agent: NodeAgent
    daemon: Daemon
    addr: str
    auth: bytes
    noise: bool
    outcomes: queue.Queue = field(default_factory=queue.Queue)
    accepts: int = 0
    _listener: socket.socket | None = None
    _accept: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _socks: list[socket.socket] = field(default_factory=list)

    def outcome(self, timeout: float = 5.0) -> BaseException | None:
        """How the next connection to end ended (None: without an error)."""
        try:
            return self.outcomes.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no connection of the node ended within {timeout} s") from None

    def serve(self) -> None:
        self._listener.settimeout(0.05)
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(None)
            self.accepts += 1
            self._socks.append(sock)
            t = threading.Thread(target=self._connection, args=(sock,), name="test-node-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _connection(self, sock: socket.socket) -> None:
        outcome = None
        try:
            if self.noise:
                ep = Endpoint.from_tcp_secure(sock, self.auth, NoiseRole.Responder, self.agent.handshake_timeout)
            else:
                ep = Endpoint.from_tcp(sock)
            self.agent.connection().serve(ep)
        except Exception as e:  # what the CLI would log with the peer
            outcome = e
        finally:
            sock.close()
            self.outcomes.put(outcome)

    def stop(self) -> None:
        """Stops accepting, hangs up every connection and joins every thread it started."""
        self._stop.set()
        self._accept.join(JOIN_TIMEOUT)
        self._listener.close()
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(JOIN_TIMEOUT)
        self.daemon.close()
        stuck = [t.name for t in [self._accept, *self._threads] if t.is_alive()]
        assert not stuck, f"node threads still running after stop: {stuck}"


@pytest.fixture
def start_node():
    """`start_node(daemon=None, *, handshake_s=2.0, idle_s=0.0, auth=b"", noise=None,
    max_lanes=0, identity="node-a", model="mock")` -> ServedNode, stopped after the test.
    With a token the link is Noise unless `noise=False` (then only HELLO carries it)."""
    nodes: list[ServedNode] = []

    def start(
        daemon: Daemon | None = None,
        *,
        handshake_s: float = 2.0,
        idle_s: float = 0.0,
        auth: bytes = b"",
        noise: bool | None = None,
        max_lanes: int = 0,
        identity: str = "node-a",
        model: str = "mock",
    ) -> ServedNode:
        daemon = daemon if daemon is not None else MockDaemon()
        agent = (
            NodeAgent(daemon, identity, model)
            .with_max_lanes(max_lanes)
            .with_timeouts(handshake_s, idle_s)
            .with_auth(auth)
        )
        listener = socket.create_server(("127.0.0.1", 0))
        addr = "127.0.0.1:%d" % listener.getsockname()[1]
        node = ServedNode(agent, daemon, addr, auth, bool(auth) if noise is None else noise, _listener=listener)
        node._accept = threading.Thread(target=node.serve, name="test-node-accept", daemon=True)
        node._accept.start()
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.stop()


@pytest.fixture
def node(start_node) -> ServedNode:
    """A mock node with the default settings of `start_node`."""
    return start_node()


@pytest.fixture
def noded(tmp_path):
    """`noded(*args, ready=SERVING, **env)` -> a `superfluid-noded` process (`nodeproc.Noded`)
    with its own `SUPERFLUID_HOME` under `tmp_path`, killed after the test."""
    from nodeproc import SERVING, Noded

    started: list[Noded] = []

    def start(*args, ready=SERVING, **env) -> Noded:
        node = Noded(args, tmp_path, ready, **env)
        started.append(node)
        return node

    yield start
    for node in started:
        node.kill()
