"""The Rust `fleet_one_node` scenarios, against this node: one head, one node, end to end."""

import pytest

from conformance.head import LEASE, FleetHead
from conformance.reference import mock_tokens
from linkf.errors import LinkFError, Unauthorized
from proto import finish
from nodeagent.engine.mock import MockDaemon
from proto.params import GenParams
from proto.linkf import TokenEventPayload


def test_fleet_generation_matches_local_token_for_token(node):
    prompt = list(range(200, 232))
    with FleetHead.connect(node.addr) as head:
        assert head.node.loadable_models == ["mock"]
        head.assign(42, GenParams())
        head.append(42, prompt)
        gen = head.generate(42, 16)

    assert gen.finish == finish.LENGTH
    assert gen.tokens == mock_tokens(prompt, 16), "fleet path diverged from the mock's spec"
    head.wal.assert_single_contiguous_streams()
    committed = head.wal.session_events(42)
    tokens = [t for c in committed if isinstance(c.event.payload, TokenEventPayload.Tokens) for t in c.event.payload.tokens]
    finishes = [c for c in committed if isinstance(c.event.payload, TokenEventPayload.Finish)]
    assert tokens == gen.tokens, "committed tokens diverged"
    assert len(finishes) == 1, "exactly one Finish event"
    assert len(committed) <= len(gen.tokens) + 1, "coalescing must not increase the event count"


def test_a_keyed_node_serves_over_an_encrypted_link_and_refuses_another_key(start_node):
    node = start_node(auth=b"the fleet token")
    prompt = list(range(300, 332))
    with pytest.raises(LinkFError):
        FleetHead.connect(node.addr, auth=b"another token", timeout=2.0)
    assert isinstance(node.outcome(), Unauthorized)
    with FleetHead.connect(node.addr, auth=b"the fleet token") as head:
        head.assign(7, GenParams(), LEASE)
        head.append(7, prompt)
        assert head.generate(7, 8).tokens == mock_tokens(prompt, 8)


def test_fleet_reassignment_fences_and_second_generation_wins(node):
    prompt = list(range(10, 26))
    with FleetHead.connect(node.addr) as head:
        e1 = head.assign(7, GenParams())
        head.append(7, prompt)
        g1 = head.generate(7, 8)
        assert g1.tokens
        e2 = head.assign(7, GenParams())
        assert e2 > e1
        head.append(7, prompt)
        g2 = head.generate(7, 8)
    assert g2.tokens == g1.tokens == mock_tokens(prompt, 8), "same prompt, same greedy output"
    head.wal.assert_single_contiguous_streams()


def test_a_node_refusal_reports_a_finish_reason_instead_of_dropping_the_link(start_node):
    node = start_node(MockDaemon(max_context=64))
    with FleetHead.connect(node.addr) as head:
        assert head.node.capacity.max_context_tokens == 64, "the node advertises its real window"
        head.assign(1, GenParams())
        head.append(1, list(range(64 + 32)))
        g = head.generate(1, 8)
        assert g.finish == finish.REFUSED, "the node reports why it refused"
        assert g.tokens == [], "a refused generation produces nothing"

        head.assign(2, GenParams())
        head.append(2, list(range(8)))
        g = head.generate(2, 4)
        assert g.tokens == mock_tokens(list(range(8)), 4), "the connection still serves"


def test_a_second_head_reusing_a_session_id_is_never_left_hanging(node):
    session = 1 << 40
    with FleetHead.connect(node.addr) as first:
        first.assign(session, GenParams())
        first.append(session, list(range(8)))
        for _ in range(3):
            assert len(first.generate(session, 4).tokens) == 4

    with FleetHead.connect(node.addr) as second:
        second.assign(session, GenParams())
        second.append(session, list(range(8)))
        g = second.generate(session, 4)
        assert g.finish == finish.DECLINED or g.tokens, "either it generated or it said why not"

        fresh = session + 9_999
        second.assign(fresh, GenParams())
        second.append(fresh, list(range(8)))
        assert len(second.generate(fresh, 4).tokens) == 4, "the connection still serves"
