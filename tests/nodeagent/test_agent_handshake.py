"""The handshake (node-behaviour.md §1.1): a silent peer is dropped, versions are negotiated,
the role and the token are checked, and HELLO_ACK_F says what the node is."""

import logging
import time

import pytest

from conformance.head import LEASE, FleetHead
from conformance.raw import hung_up, raw_connect
from conformance.reference import mock_tokens
from linkf.driver import Endpoint
from linkf.errors import LinkFError, Protocol, Unauthorized
from proto import finish
from proto.params import GenParams
from proto.envelope import MAX_FRAME
from proto.handshake import LinkRole
from proto.linkf import msg_type


def test_a_silent_peer_is_dropped_after_the_handshake_timeout_while_others_are_served(start_node, caplog):
    caplog.set_level(logging.WARNING, logger="nodeagent.agent")
    node = start_node(handshake_s=0.3)
    silent = raw_connect(node.addr)
    opened = time.monotonic()
    with FleetHead.connect(node.addr) as head:
        head.assign(1, GenParams())
        head.append(1, [1, 2, 3])
        assert head.generate(1, 4).tokens == mock_tokens([1, 2, 3], 4), "served past the silent peer"
    assert hung_up(silent, 3.0), "the silent peer was never dropped"
    assert time.monotonic() - opened >= 0.3
    assert node.outcome() is None, "a silent peer is no error"
    assert "node-agent dropped a silent connection (no Hello)" in caplog.messages
    silent.close()


@pytest.mark.parametrize(
    "offered, chosen",
    [((2, 3), 3), ((2, 2), 2), ((3, 3), 3), ((1, 2), 2), ((3, 9), 3)],
)
def test_the_node_answers_with_the_highest_common_version_and_frames_carry_it(node, offered, chosen):
    with FleetHead.connect(node.addr, versions=offered) as head:
        assert head.node.chosen_version == chosen
        assert head.endpoint.version() == chosen
        head.assign(1, GenParams())
        head.append(1, [5, 6])
        head.generate(1, 2)
        assert {r.frame.proto_version for r in head.of_type(msg_type.TOKEN_EVENTS)} == {chosen}


@pytest.mark.parametrize(
    "versions, role, reason",
    [
        ((4, 5), LinkRole.HeadDaemon, "no common proto version"),
        ((1, 1), LinkRole.HeadDaemon, "no common proto version"),
        ((2, 3), LinkRole.Worker, "peer is not a head daemon"),
        ((2, 3), LinkRole.NodeAgent, "peer is not a head daemon"),
    ],
)
def test_a_hello_the_node_cannot_serve_ends_the_connection_with_the_reason(node, versions, role, reason):
    with pytest.raises(LinkFError):
        FleetHead.connect(node.addr, versions=versions, role=role, timeout=2.0)
    outcome = node.outcome()
    assert isinstance(outcome, Protocol) and outcome.reason == reason


def test_a_hello_with_another_token_is_unauthorized(start_node):
    node = start_node(auth=b"right", noise=False)
    with pytest.raises(LinkFError):
        FleetHead.connect(node.addr, auth=b"", noise=False, timeout=2.0)
    assert isinstance(node.outcome(), Unauthorized)
    with pytest.raises(LinkFError):
        FleetHead.connect(node.addr, auth=b"wrong", noise=False, timeout=2.0)
    assert isinstance(node.outcome(), Unauthorized)
    with FleetHead.connect(node.addr, auth=b"right", noise=False) as head:
        assert head.node.node_identity == "node-a"


def test_hello_ack_says_who_the_node_is_and_what_it_holds(start_node):
    node = start_node(identity="node-z", max_lanes=6)
    started = time.monotonic()
    with FleetHead.connect(node.addr) as head:
        ack = head.node
        assert ack.node_identity == "node-z"
        assert ack.loadable_models == ["mock"]
        assert ack.feature_flags == 0
        assert (ack.limits.max_frame, ack.limits.transfer_window) == (MAX_FRAME, 8)
        assert (ack.limits.max_transfer, ack.limits.transfer_budget) == (1 << 26, 1 << 28)
        cap = ack.capacity
        assert cap.max_sessions == 2**32 - 1
        assert cap.max_context_tokens == 4096
        assert cap.max_lanes == 6
        assert (cap.kv_blocks_used, cap.kv_blocks_total) == (0, 1024)
        assert cap.active_sessions == cap.lanes_active == cap.queue_depth == 0
        assert 0 <= cap.sampled_at_ms <= (time.monotonic() - started) * 1000 + 50

        # A session with a context counts as active.
        head.assign(3, GenParams())
        head.append(3, [1])
        head.generate(3, 1)
    with FleetHead.connect(node.addr) as again:
        assert again.node.capacity.active_sessions == 1


def test_a_request_for_a_session_before_any_assign_is_declined_not_dropped(node):
    with FleetHead.connect(node.addr) as head:
        head.session.assign_session(5, 1, LEASE, 0, "mock")  # the node never hears of it
        g = head.generate(5, 4)
        assert g.finish == finish.DECLINED and g.tokens == []


def test_a_zero_handshake_timeout_waits_for_hello_forever(start_node):
    node = start_node(handshake_s=0)
    sock = raw_connect(node.addr)
    assert not hung_up(sock, 0.6), "a slow head was dropped"
    endpoint = Endpoint.from_tcp(sock)
    assert endpoint.hello_as_head(b"", 2.0).node_identity == "node-a"
    endpoint.close()
