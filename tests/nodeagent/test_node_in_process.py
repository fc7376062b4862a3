"""`noded.Node` run inside another program (as the test fixtures run it): each connection's end
reaches `on_connection_end` with the error itself, and `stop` then `close` leave no connection
or thread of the node behind."""

from __future__ import annotations

import queue
import socket

from polling import background, wait_until

from conformance.head import FleetHead
from conformance.raw import hung_up, raw_connect
from linkf.errors import Closed
from linkf.driver import show_address
from nodeagent.engine.mock import MockDaemon
from nodeagent.noded import Node


def test_close_hangs_up_every_connection_and_joins_its_thread_and_each_end_is_told():
    ended: queue.Queue = queue.Queue()
    daemon = MockDaemon()
    node = Node(daemon, identity="in-process", on_connection_end=lambda peer, error: ended.put((peer, error)))
    listener = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    accepting = background(lambda: node.accept_until_stopped(listener), timeout=10)
    head = FleetHead.connect(addr)
    silent = raw_connect(addr)
    try:
        assert wait_until(lambda: node.admission.counts() == (2, 1)), "one past HELLO, one still in it"
        assert ended.empty()
        node.stop()
        accepting()
        assert node.close(5.0) == [], "every connection's thread ended"
        assert head.closed_by_node(1.0) and hung_up(silent, 1.0)
        outcomes = dict(ended.get(timeout=1.0) for _ in range(2))
        assert isinstance(outcomes.pop(show_address(silent.getsockname())), Closed), "closed before its HELLO"
        assert list(outcomes.values()) == [None], "a link that ends past HELLO is no error"
        assert node.admission.counts() == (0, 0)
    finally:
        head.close()
        silent.close()
        listener.close()
        daemon.close()

