"""linkf.head and the kit's WalStub: the unit tests of head.rs, ported, and the end-to-end session tests
of linkf_e2e.rs / linkf_tcp.rs over real endpoints."""

import threading

import pytest
from linkpairs import ackf, tcp_pair, unix_pair
from polling import TIMEOUT

from conformance.wal import WalStub
from linkf import AgentSession, HeadSession, SelfFence
from proto import postcard
from proto.linkf import (
    GenerationBudgetsMsg,
    Lease,
    LeaseRenewMsg,
    ReconcileAckMsg,
    SessionReconcileAck,
    TokenEvent,
    TokenEventPayload,
    TokenEventsMsg,
    msg_type,
)
from proto.postcard import U32, Vec

LEASE = Lease(duration_ms=1000, renew_by_ms=600)
BUDGETS = GenerationBudgetsMsg(max_new_tokens=64, max_wall_ms=1000)


def ev(session, epoch, generation, seq):
    return TokenEvent(
        session_id=session,
        epoch=epoch,
        generation_id=generation,
        event_seq=seq,
        payload=TokenEventPayload.Tokens(tokens=[seq]),
    )


def batch(*events):
    return TokenEventsMsg(events=list(events))


def test_generate_retry_reuses_ids():
    wal = WalStub()
    h = HeadSession(commit=wal.commit)
    h.assign_session(1, 5, LEASE, 0, "chatml")
    g1 = h.generate(1, 100, BUDGETS)
    g2 = h.generate(1, 100, BUDGETS)
    assert g1.command_id == g2.command_id
    assert g1.generation_id == g2.generation_id


def test_retransmit_commits_zero_bytes_and_reacks():
    wal = WalStub()
    h = HeadSession(commit=wal.commit)
    h.assign_session(1, 5, LEASE, 0, "chatml")
    b = batch(ev(1, 5, 100, 0), ev(1, 5, 100, 1))
    acks = h.on_token_events(b)
    assert [a.watermark for a in acks] == [1]
    assert wal.total_committed() == 2
    acks = h.on_token_events(b)
    assert [a.watermark for a in acks] == [1]
    assert wal.total_committed() == 2


def test_stale_epoch_events_never_commit():
    wal = WalStub()
    h = HeadSession(commit=wal.commit)
    h.assign_session(1, 5, LEASE, 0, "chatml")
    h.on_token_events(batch(ev(1, 5, 100, 0)))
    h.assign_session(1, 6, LEASE, 0, "chatml")
    assert h.on_token_events(batch(ev(1, 5, 100, 1))) == []
    assert wal.total_committed() == 1
    wal.assert_single_contiguous_streams()


def test_reconcile_reports_none_when_nothing_committed():
    wal = WalStub()
    h = HeadSession(commit=wal.commit)
    h.assign_session(1, 5, LEASE, 0, "chatml")
    h.generate(1, 100, GenerationBudgetsMsg(max_new_tokens=4, max_wall_ms=100))
    (s,) = h.reconcile().sessions
    assert [(w.generation_id, w.watermark) for w in s.generation_watermarks] == [(100, None)]


def test_a_gap_commits_nothing_and_is_not_acknowledged():
    wal = WalStub()
    h = HeadSession(commit=wal.commit)
    h.assign_session(1, 5, LEASE)
    assert h.on_token_events(batch(ev(1, 5, 100, 1))) == []
    assert wal.total_committed() == 0


def test_commands_count_up_and_set_the_session_watermark():
    h = HeadSession.starting_at(1 << 32)
    a = h.assign_session(1, 5, LEASE)
    g = h.generate(1, 100, BUDGETS)
    c = h.append_content(1, postcard.to_bytes([1, 2, 3], Vec[U32]))
    assert (a.command_id, g.command_id, c.command_id) == (1 << 32, (1 << 32) + 1, (1 << 32) + 2)
    assert c.epoch == 5 and postcard.from_bytes(Vec[U32], c.blocks) == [1, 2, 3]
    assert h.reconcile().sessions[0].command_watermark == (1 << 32) + 2
    assert h.append_content(2, b"") is None and h.generate(2, 1, BUDGETS) is None


def test_lease_renewals_are_granted_for_the_current_epoch_only():
    wal = WalStub()
    h = HeadSession(commit=wal.commit)
    h.assign_session(1, 5, LEASE)
    grant = h.on_lease_renew(LeaseRenewMsg(session_id=1, epoch=5))
    assert (grant.epoch, grant.duration_ms, grant.renew_by_ms) == (5, 1000, 600)
    assert h.on_lease_renew(LeaseRenewMsg(session_id=1, epoch=4)) is None
    assert h.on_lease_renew(LeaseRenewMsg(session_id=2, epoch=5)) is None


def test_revoke_and_reconcile_ack():
    wal = WalStub()
    h = HeadSession(commit=wal.commit)
    h.assign_session(1, 5, LEASE)
    h.assign_session(2, 6, LEASE)
    r = h.revoke(1)
    assert (r.session_id, r.epoch) == (1, 5)
    assert h.revoke(1) is None and h.current_epoch(1) is None
    assert [s.session_id for s in h.reconcile().sessions] == [2]
    ack = ReconcileAckMsg(sessions=[SessionReconcileAck(session_id=2, held=False), SessionReconcileAck(session_id=3, held=True)])
    assert h.on_reconcile_ack(ack) == [2]


def test_wal_flags_a_gap_or_a_duplicate():
    w = WalStub()
    w.commit(ev(1, 5, 100, 0))
    w.commit(ev(1, 5, 100, 1))
    w.assert_single_contiguous_streams()
    assert [c.committed_id for c in w.session_events(1)] == [0, 1]
    w.commit(ev(1, 5, 100, 1))
    with pytest.raises(AssertionError, match="gap or duplicate"):
        w.assert_single_contiguous_streams()
    w = WalStub()
    w.commit(ev(1, 5, 100, 1))
    with pytest.raises(AssertionError):
        w.assert_single_contiguous_streams()


# End to end, over socketpairs and loopback TCP (linkf_e2e.rs, linkf_tcp.rs)


def connect(make):
    head, node = make()
    t = threading.Thread(target=node.answer_hello_as_agent, args=(ackf("node-a"), b"", TIMEOUT), daemon=True)
    t.start()
    assert head.hello_as_head(b"", TIMEOUT).node_identity == "node-a"
    t.join(TIMEOUT)
    return head, node


def read(ep, count):
    """The next ``count`` messages ``ep`` receives, decoded, with their types."""
    got = []
    while len(got) < count:
        got += [(m.msg_type, m.msg) for m in ep.pump()]
    return got


def tokens(*ts):
    return TokenEventPayload.Tokens(tokens=list(ts))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("make", [unix_pair, tcp_pair], ids=["unix", "tcp"])
def test_session_lifecycle_recovery_and_fencing(make):
    wal = WalStub()
    head, agent = HeadSession(commit=wal.commit), AgentSession()
    head_ep, agent_ep = connect(make)
    lease = Lease(duration_ms=10_000, renew_by_ms=6_000)
    head_ep.send(msg_type.SESSION_ASSIGN, head.assign_session(1, 5, lease, 0, "chatml"))
    head_ep.send(msg_type.GENERATE_REQ, head.generate(1, 100, GenerationBudgetsMsg(max_new_tokens=8, max_wall_ms=1000)))
    (t1, assign), (t2, gen) = read(agent_ep, 2)
    assert (t1, t2) == (msg_type.SESSION_ASSIGN, msg_type.GENERATE_REQ)
    assert agent.on_assign(assign, 0)
    assert agent.on_generate(gen)

    for k in range(3):
        agent_ep.send(msg_type.TOKEN_EVENTS, agent.emit(1, 100, tokens(k)))
    acks = []
    for t, msg in read(head_ep, 3):
        assert t == msg_type.TOKEN_EVENTS
        acks += head.on_token_events(msg)
    assert wal.total_committed() == 3
    agent.on_watermark_ack(acks[0])
    assert agent.unacked_events(1, 100) == 2
    head_ep.close()
    agent_ep.close()

    head_ep, agent_ep = connect(make)
    head_ep.send(msg_type.RECONCILE, head.reconcile())
    ((t, rec),) = read(agent_ep, 1)
    assert t == msg_type.RECONCILE
    assert rec.sessions[0].generation_watermarks[0].watermark == 2
    ack, again = agent.on_reconcile(rec, 1000)
    agent_ep.send(msg_type.RECONCILE_ACK, ack)
    assert ack.sessions[0].held and again == []
    assert read(head_ep, 1)[0][1] == ack

    b4 = agent.emit(1, 100, tokens(3))
    agent.emit(1, 100, tokens(4))  # lost on the way
    assert head.on_token_events(b4)[0].watermark == 3
    _, again = agent.on_reconcile(head.reconcile(), 1100)
    assert [[e.event_seq for e in b.events] for b in again] == [[4]]
    before = wal.total_committed()
    head.on_token_events(again[0])
    assert wal.total_committed() == before + 1
    acks = head.on_token_events(again[0])
    assert wal.total_committed() == before + 1
    assert acks[0].watermark == 4

    old_agent, new_agent = agent, AgentSession()
    assert new_agent.on_assign(head.assign_session(1, 6, lease, 0, "chatml"), 2000)
    assert new_agent.on_generate(head.generate(1, 101, GenerationBudgetsMsg(max_new_tokens=4, max_wall_ms=500)))
    late = old_agent.emit(1, 100, tokens(99))
    before = wal.total_committed()
    assert head.on_token_events(late) == []
    assert wal.total_committed() == before
    ack, _ = old_agent.on_reconcile(head.reconcile(), 2100)
    assert not ack.sessions[0].held
    assert old_agent.is_fenced(1) is True

    assert head.on_token_events(new_agent.emit(1, 101, tokens(7)))[0].epoch == 6
    (renew,) = new_agent.needs_renew(8_500)
    new_agent.on_lease_grant(head.on_lease_renew(renew), 8_500)
    assert new_agent.poll(12_000) == [], "renewed lease expired early"
    assert new_agent.poll(19_000) == [SelfFence(session_id=1)]
    assert new_agent.emit(1, 101, tokens(8)) is None
    assert new_agent.unacked_events(1, 101) == 1
    wal.assert_single_contiguous_streams()


def test_stale_lease_grant_for_superseded_epoch_rejected():
    wal = WalStub()
    head, agent = HeadSession(commit=wal.commit), AgentSession()
    agent.on_assign(head.assign_session(1, 5, LEASE, 0, "chatml"), 0)
    renew = LeaseRenewMsg(session_id=1, epoch=5)
    grant = head.on_lease_renew(renew)
    agent.on_assign(head.assign_session(1, 6, LEASE, 0, "chatml"), 100)
    agent.on_lease_grant(grant, 100)
    assert agent.poll(1200) == [SelfFence(session_id=1)]
    assert head.on_lease_renew(renew) is None
