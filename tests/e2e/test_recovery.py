"""The Rust `fleet_recovery` scenario: a head that reconnects finds its session held and
generates on where it left off."""

from conformance.head import LEASE, FleetHead
from conformance.reference import mock_tokens
from proto.params import GenParams


def test_reconnect_holds_session_and_resumes_generation(node):
    prompt = list(range(300, 340))
    with FleetHead.connect(node.addr) as head:
        head.assign(11, GenParams(), LEASE)
        head.append(11, prompt)
        g1 = head.generate(11, 8)
        assert g1.tokens == mock_tokens(prompt, 8)
        committed_before = head.wal.total_committed()

        ack = head.reconnect()
        assert [s.held for s in ack.sessions] == [True]
        assert head.wal.total_committed() == committed_before, "reconnect committed phantom events"

        g2 = head.generate(11, 8)
        assert g2.tokens == g1.tokens, "resumed generation diverged"
        head.wal.assert_single_contiguous_streams()
