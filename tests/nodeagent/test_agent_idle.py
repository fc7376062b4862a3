"""Idle connections (node-behaviour.md §1.3): on version 2 the node drops a connection the head
has been quiet on for the idle timeout, only while nothing runs; on version 3 heartbeats flow
both ways and a silent head is dropped by the endpoint's silence limit."""

import logging
import time

from conformance.head import FleetHead
from conformance.reference import mock_tokens
from proto import finish
from nodeagent.engine.mock import MockDaemon
from proto.params import GenParams
from proto.linkf import msg_type

IDLE = 0.6


def test_v2_an_idle_connection_is_dropped_but_never_one_that_generates(start_node, caplog):
    caplog.set_level(logging.INFO, logger="nodeagent.agent")
    node = start_node(MockDaemon(token_delay_s=0.02), idle_s=IDLE)
    with FleetHead.connect(node.addr, versions=(2, 2)) as idle, FleetHead.connect(node.addr, versions=(2, 2)) as busy:
        opened = time.monotonic()
        busy.assign(1, GenParams())
        busy.append(1, [1, 2])
        busy.lose_events = True  # no watermark acks: the head says nothing while it waits
        g = busy.generate(1, 60, timeout=10.0)  # about 1.2 s, twice the idle timeout
        assert (g.finish, g.tokens) == (finish.LENGTH, mock_tokens([1, 2], 60)), "kept while it generated"
        assert time.monotonic() - opened >= 2 * IDLE

        assert idle.closed_by_node(0.5), "the idle v2 connection was dropped meanwhile"
        assert busy.closed_by_node(IDLE + 1.0), "and the busy one once it went idle"
    assert node.outcome() is None and node.outcome() is None
    assert caplog.messages.count("node-agent dropped an idle connection") == 2
    assert not [r for r in idle.received if r.frame.msg_type == msg_type.KEEPALIVE], "no heartbeats on v2"


def test_v3_heartbeats_keep_a_link_and_silence_ends_it(start_node, caplog):
    caplog.set_level(logging.WARNING, logger="nodeagent.agent")
    node = start_node(idle_s=IDLE)
    with FleetHead.connect(node.addr, heartbeat=IDLE / 3) as tended, FleetHead.connect(node.addr, heartbeat=60.0) as mute:
        assert tended.endpoint.version() == 3
        deadline = time.monotonic() + 3 * IDLE
        while time.monotonic() < deadline:
            tended.pump()
        beats = [r for r in tended.received if r.frame.msg_type == msg_type.KEEPALIVE]
        assert len(beats) >= 5, "the node beats every idle/3 when it has nothing else to send"

        tended.assign(1, GenParams())
        tended.append(1, [3, 4])
        assert tended.generate(1, 4).tokens == mock_tokens([3, 4], 4), "the tended link was kept"

        assert mute.closed_by_node(0.5), "the silent v3 head was dropped"
    assert node.outcome() is None
    (silent,) = [r for r in caplog.records if r.getMessage() == "node-agent dropped a connection the head went silent on"]
    assert silent.fields["quiet_ms"] >= IDLE * 1000
