"""The node's side of the Rust `fleet_liveness` scenarios: heads whose connections the node
drops when idle reconnect and are served exactly; a tended connection is kept; a session
re-bound on a fresh connection generates from its new content; the handshake names the node,
its window and its lanes. Heads offer version 2, as the Rust head does."""

import threading
import time

import pytest

from conformance.head import FleetHead
from conformance.reference import mock_tokens
from linkf.errors import LinkFError, Unauthorized
from proto.params import GenParams

V2 = (2, 2)
IDLE = 0.3


def stream(head: FleetHead, session: int, prompt: list[int]) -> list[int]:
    """Places `session`, generates 8 tokens and revokes it, reconnecting once if the node
    dropped the connection while it sat idle."""
    try:
        return _stream(head, session, prompt)
    except LinkFError:
        head.reconnect()
        return _stream(head, session, prompt)


def _stream(head: FleetHead, session: int, prompt: list[int]) -> list[int]:
    head.assign(session, GenParams())
    head.append(session, prompt)
    tokens = head.generate(session, 8).tokens
    head.revoke(session)
    return tokens


def round_of(heads: list[FleetHead], first: int) -> dict[int, list[int] | BaseException]:
    results: dict[int, list[int] | BaseException] = {}

    def run(head: FleetHead, session: int) -> None:
        try:
            results[session] = stream(head, session, [1, 2, 3, session])
        except BaseException as e:  # reported by the assertion below
            results[session] = e

    threads = [threading.Thread(target=run, args=(h, first + k)) for k, h in enumerate(heads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    return results


def assert_round(results, first: int, n: int, when: str) -> None:
    for session in range(first, first + n):
        assert results.get(session) == mock_tokens([1, 2, 3, session], 8), f"{when}: session {session}"


def test_streams_survive_nodes_dropping_idle_connections(start_node):
    a, b = start_node(idle_s=IDLE, identity="idle-a"), start_node(idle_s=IDLE, identity="idle-b")
    heads = [FleetHead.connect(n.addr, versions=V2) for n in (a, b) for _ in range(4)]
    try:
        assert_round(round_of(heads, 1), 1, 8, "warm")
        time.sleep(IDLE * 3)
        assert_round(round_of(heads, 100), 100, 8, "after the nodes dropped every idle connection")
        assert_round(round_of(heads, 200), 200, 8, "after that")
    finally:
        for h in heads:
            h.close()
    assert a.opened == b.opened == 8, "each connection was dropped once and opened again once"


def test_tending_keeps_idle_connections_open(start_node):
    node = start_node(idle_s=IDLE, identity="tended")
    with FleetHead.connect(node.addr, versions=V2) as head:
        assert _stream(head, 1, [1, 2, 3, 1]) == mock_tokens([1, 2, 3, 1], 8)
        until = time.monotonic() + IDLE * 3
        while time.monotonic() < until:
            head.keepalive()
            head.idle(0.05)
        assert _stream(head, 2, [1, 2, 3, 2]) == mock_tokens([1, 2, 3, 2], 8)
    assert node.opened == 1, "the tended connection was kept, not reopened"


def test_a_session_appended_after_an_idle_drop_is_bound_on_the_new_connection(start_node):
    node = start_node(idle_s=IDLE, identity="rebind")
    with FleetHead.connect(node.addr, versions=V2) as head:
        head.assign(1, GenParams())
        head.append(1, [1, 2, 3, 4])
        assert head.closed_by_node(IDLE * 3)
        (state,) = head.reconnect().sessions
        assert state.held, "the node kept the session across its connections"
        grown = [1, 2, 3, 4, 5, 6]
        head.append(1, grown)
        assert head.generate(1, 8).tokens == mock_tokens(grown, 8)


def test_the_handshake_names_the_node_its_window_and_lanes(start_node):
    node = start_node(identity="probe-a", max_lanes=4)
    heads = [FleetHead.connect(node.addr, versions=V2) for _ in range(4)]
    try:
        for h in heads:
            assert (h.node.node_identity, h.node.loadable_models) == ("probe-a", ["mock"])
            assert h.node.capacity.max_context_tokens > 0
            assert h.node.capacity.max_lanes == 4
        for s in range(1, 9):
            assert _stream(heads[s % 4], s, [1, 2, 3, s]) == mock_tokens([1, 2, 3, s], 8)
    finally:
        for h in heads:
            h.close()
    assert node.opened == 4, "one connection per lane, each reused"


def test_a_key_mismatch_is_refused(start_node):
    node = start_node(auth=b"right")
    with pytest.raises(LinkFError):
        FleetHead.connect(node.addr, auth=b"wrong", versions=V2, timeout=2.0)
    assert isinstance(node.outcome(), Unauthorized)
