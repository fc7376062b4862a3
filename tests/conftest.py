"""Shared fixtures: a node agent served on an ephemeral loopback port by the product's own
accept loop (`noded.Node`), one thread per connection, as `superfluid-noded` serves it; stopped
and joined after each test."""

from __future__ import annotations

import gc
import queue
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from linkf.driver import Endpoint  # noqa: E402
from nodeagent.agent import NodeAgent  # noqa: E402
from nodeagent.daemon import Daemon  # noqa: E402
from nodeagent.engine.mock import MockDaemon  # noqa: E402
from nodeagent.noded import LISTEN_BACKLOG, Node, NodeConfig  # noqa: E402
from nodeagent.outbox import STREAM_INTERVAL_S  # noqa: E402
from nodeagent.observe import NodeObserver, Observers  # noqa: E402

JOIN_TIMEOUT = 5.0
#: Torch's intra-op threads for a module's tests unless it names its own `TORCH_THREADS`.
TORCH_THREADS = 1


@pytest.fixture(scope="module", autouse=True)
def torch_threads(request):
    """Each module's tests run with the torch thread count it asks for. Set at import instead,
    the module collected last would decide it for the whole run (collection imports every
    module first): the engine tests meant one thread and ran with two, and on a loaded 2-core
    machine each parallel region waits for a descheduled partner thread."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(getattr(request.module, "TORCH_THREADS", TORCH_THREADS))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """Each module starts with everything alive before it frozen out of the collector's
    reach. Most tests keep their node, head or both in this process, and a full collection
    holds the GIL over every object: late in the suite one scanned ~850k of them (imports,
    hypothesis, earlier modules) for up to 710 ms on this 2-core machine, past the 700 ms a
    1 s lease leaves its head to answer a renewal. That failed a CI run: the lease row's
    renewing head had half its sessions fenced, as it does when a 1.3 s collection is made to
    run there on purpose (0.66 s passes). Frozen, a collection scans only what the module
    itself made (the worst then 330 ms, in a test that made 315k objects of garbage);
    collecting first keeps garbage out of the frozen part."""
    gc.collect()
    gc.freeze()
    yield


class PlainLinkNode(Node):
    """The Rust node's link: the token rides in HELLO only, no Noise under it. No mode of the
    product (a token there always means Noise); kept to test the agent's own HELLO check."""

    def _open(self, sock: socket.socket) -> Endpoint:
        return Endpoint.from_tcp(sock)


class Opened(NodeObserver):
    """The peers of the connections whose HELLO was answered, in order."""

    def __init__(self) -> None:
        self.peers: list[str] = []

    def connection_opened(self, peer: str) -> None:
        self.peers.append(peer)


@dataclass
class ServedNode:
    """`node` accepting on `addr` on a thread of the test's; `outcomes` gets, per connection
    that ended, None or the exception its `serve` raised."""

    node: Node
    addr: str
    listener: socket.socket
    opened_peers: Opened
    outcomes: queue.Queue
    accepting: threading.Thread

    @property
    def agent(self) -> NodeAgent:
        return self.node.agent

    @property
    def daemon(self) -> Daemon:
        return self.node.daemon

    @property
    def opened(self) -> int:
        """How many connections got past their HELLO."""
        return len(self.opened_peers.peers)

    def outcome(self, timeout: float = 5.0) -> BaseException | None:
        """How the next connection to end ended (None: without an error)."""
        try:
            return self.outcomes.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no connection of the node ended within {timeout} s") from None

    def stop(self) -> None:
        """Stops accepting, hangs up every connection and joins every thread the node started."""
        self.node.stop()
        self.accepting.join(JOIN_TIMEOUT)
        self.listener.close()
        stuck = self.node.close(JOIN_TIMEOUT)
        self.daemon.close()
        if self.accepting.is_alive():
            stuck.append(self.accepting.name)
        assert not stuck, f"node threads still running after stop: {stuck}"


@pytest.fixture
def start_node():
    """`start_node(daemon=None, *, handshake_s=2.0, idle_s=0.0, auth=b"", noise=None,
    max_lanes=0, identity="node-a", model="mock", stream_interval_s=0.04)` -> ServedNode, stopped after the test.
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
        stream_interval_s: float = STREAM_INTERVAL_S,
    ) -> ServedNode:
        config = NodeConfig(
            model_name=model,
            max_lanes=max_lanes,
            handshake_timeout_s=handshake_s,
            idle_timeout_s=idle_s,
            stream_interval_s=stream_interval_s,
        )
        opened, outcomes = Opened(), queue.Queue()
        kind = PlainLinkNode if noise is False else Node
        node = kind(
            daemon if daemon is not None else MockDaemon(),
            config,
            auth,
            identity,
            Observers(opened),
            on_connection_end=lambda _peer, error: outcomes.put(error),
        )
        listener = socket.create_server(("127.0.0.1", 0), backlog=LISTEN_BACKLOG)
        accepting = threading.Thread(
            target=node.accept_until_stopped, args=(listener,), name="test-node-accept", daemon=True
        )
        served = ServedNode(node, f"127.0.0.1:{listener.getsockname()[1]}", listener, opened, outcomes, accepting)
        accepting.start()
        nodes.append(served)
        return served

    yield start
    for served in nodes:
        served.stop()


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
