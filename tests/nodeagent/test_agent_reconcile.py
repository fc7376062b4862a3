"""RECONCILE after a reconnect (node-behaviour.md §1.4): the node says which sessions it still
holds, sends again what the head never acknowledged, and the held sessions become the new
connection's own (their renewals go there)."""

from conformance.head import FleetHead
from conformance.reference import mock_tokens
from proto import finish
from proto.params import GenParams
from proto.linkf import (
    Lease,
    LeaseStateMsg,
    ReconcileMsg,
    SessionReconcileState,
    TokenEventPayload,
    msg_type,
)


def committed_tokens(head: FleetHead, session_id: int) -> list[int]:
    return [
        t
        for c in head.wal.session_events(session_id)
        if isinstance(c.event.payload, TokenEventPayload.Tokens)
        for t in c.event.payload.tokens
    ]


def test_events_the_head_lost_are_sent_again_after_a_reconnect(node):
    prompt = list(range(300, 340))
    with FleetHead.connect(node.addr) as head:
        head.assign(11, GenParams(), Lease(duration_ms=120_000, renew_by_ms=1_500))
        head.append(11, prompt)
        head.lose_events = True
        req = head.request(11, 40)
        head.until(lambda: head.generations.get((11, 1)) and head.generations[(11, 1)].finish, 5.0, "the Finish")
        assert head.wal.total_committed() == 0
        sent = len(head.generations[(11, req.generation_id)].events)

        head.lose_events = False
        ack = head.reconnect()
        (state,) = ack.sessions
        assert state.session_id == 11 and state.held
        (retry,) = state.retry_ranges
        assert (retry.generation_id, retry.from_seq, retry.to_seq) == (req.generation_id, 0, sent - 1)

        head.wal.assert_single_contiguous_streams()
        assert committed_tokens(head, 11) == mock_tokens(prompt, 40)
        last = head.wal.session_events(11)[-1].event.payload
        assert last == TokenEventPayload.Finish(reason=finish.LENGTH)

        # The session is now the new connection's: its renewal is asked for here.
        head.wait_for(msg_type.LEASE_RENEW, 3.0)
        assert head.generate(11, 8).tokens == mock_tokens(prompt, 8)


def test_acknowledged_events_are_not_sent_again(node):
    with FleetHead.connect(node.addr) as head:
        head.assign(3, GenParams())
        head.append(3, [1, 2, 3])
        head.request(3, 20)
        head.until(lambda: head.wal.total_committed() and head.generations[(3, 1)].finish, 5.0, "the Finish")
        head.idle(0.1)  # let the last watermark ack reach the node
        before = head.wal.total_committed()
        ack = head.reconnect()
        assert ack.sessions[0].held and ack.sessions[0].retry_ranges == []
        assert head.wal.total_committed() == before


def test_a_session_the_node_never_held_is_reported_so(node):
    with FleetHead.connect(node.addr) as head:
        unknown = SessionReconcileState(
            session_id=777,
            epoch=5,
            lease_state=LeaseStateMsg(lease=Lease(duration_ms=1, renew_by_ms=1), elapsed_ms=0),
            command_watermark=0,
            generation_watermarks=[],
        )
        head.endpoint.send(msg_type.RECONCILE, ReconcileMsg(sessions=[unknown]))
        (state,) = head.wait_for(msg_type.RECONCILE_ACK).msg.sessions
        assert (state.session_id, state.held, state.retry_ranges) == (777, False, [])
        assert state.lease_view == unknown.lease_state
