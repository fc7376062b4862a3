"""The Rust `fleet_wedge` scenarios: a silent peer, an idle drop and a wrong token never wedge
the node. The head here offers version 2 only, as the public Rust head does."""

import pytest

from conformance.head import LEASE, FleetHead
from conformance.raw import hung_up, raw_connect
from conformance.reference import mock_tokens
from linkf.errors import LinkFError
from proto.params import GenParams

V2 = (2, 2)
PROMPT = list(range(10, 26))


def test_silent_connection_does_not_wedge_the_node(start_node):
    node = start_node(handshake_s=0.3, idle_s=2.0)
    silent = raw_connect(node.addr)
    with FleetHead.connect(node.addr, versions=V2) as head:
        head.assign(1, GenParams(), LEASE)
        head.append(1, PROMPT)
        gen = head.generate(1, 8)
        assert gen.tokens == mock_tokens(PROMPT, 8), "node served the real head after the silent one"
        head.wal.assert_single_contiguous_streams()
    assert hung_up(silent, 2.0)
    silent.close()


def test_idle_drop_is_transparent_to_the_caller(start_node):
    node = start_node(handshake_s=0.3, idle_s=0.4)
    with FleetHead.connect(node.addr, versions=V2) as head:
        head.assign(5, GenParams(), LEASE)
        head.append(5, PROMPT)
        g1 = head.generate(5, 8)
        assert head.closed_by_node(1.5), "the node dropped the idle connection"
        with pytest.raises(LinkFError):
            head.generate(5, 8, timeout=1.0)
        assert [s.held for s in head.reconnect().sessions] == [True]
        g2 = head.generate(5, 8)
        assert g2.tokens == g1.tokens, "transparent resume produced different output"
        head.wal.assert_single_contiguous_streams()


def test_node_rejects_wrong_credential_and_non_head(start_node):
    node = start_node(handshake_s=0.5, idle_s=5.0, auth=b"the-shared-secret")
    with pytest.raises(LinkFError):
        FleetHead.connect(node.addr, auth=b"wrong", versions=V2)
    with pytest.raises(LinkFError):
        FleetHead.connect(node.addr, versions=V2, timeout=1.0)
    with FleetHead.connect(node.addr, auth=b"the-shared-secret", versions=V2) as head:
        head.assign(1, GenParams(), LEASE)
        head.append(1, PROMPT)
        assert head.generate(1, 8).tokens == mock_tokens(PROMPT, 8)
