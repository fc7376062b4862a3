"""linkf.agent: the unit tests of agent.rs, ported, plus the reconcile rules they leave out."""

from linkf import AgentSession, SelfFence
from proto.linkf import (
    GenerateReqMsg,
    GenerationBudgetsMsg,
    GenerationWatermark,
    Lease,
    LeaseGrantMsg,
    LeaseStateMsg,
    ReconcileMsg,
    SessionAssignMsg,
    SessionReconcileState,
    SessionRevokeMsg,
    TokenEventPayload,
    WatermarkAckMsg,
)


def assign(session, epoch, command, duration_ms=1000, renew_by_ms=600):
    return SessionAssignMsg(
        command_id=command,
        session_id=session,
        epoch=epoch,
        lease=Lease(duration_ms=duration_ms, renew_by_ms=renew_by_ms),
        codec="chatml",
    )


def generate(command, session=1, epoch=5, generation=100):
    return GenerateReqMsg(
        command_id=command,
        session_id=session,
        epoch=epoch,
        generation_id=generation,
        budgets=GenerationBudgetsMsg(max_new_tokens=4, max_wall_ms=100),
    )


def tokens(*ts):
    return TokenEventPayload.Tokens(tokens=list(ts))


def test_assign_is_idempotent_and_epoch_is_absolute():
    a = AgentSession()
    msg = assign(1, 5, 10)
    assert a.on_assign(msg, 0)
    assert not a.on_assign(msg, 1)
    assert not a.on_assign(assign(1, 4, 11), 2)


def test_generate_replay_does_not_restart():
    a = AgentSession()
    a.on_assign(assign(1, 5, 10), 0)
    g = generate(11)
    assert a.on_generate(g)
    assert a.emit(1, 100, tokens(1)) is not None
    assert not a.on_generate(g)
    batch = a.emit(1, 100, tokens(2))
    assert batch.events[0].event_seq == 1, "stream restarted on replay"


def test_append_is_gated_on_epoch_fence_and_command_id():
    a = AgentSession()
    a.on_assign(assign(1, 5, 10), 0)
    assert a.on_append(1, 5, 20)
    assert not a.on_append(1, 5, 20)
    assert not a.on_append(1, 4, 21)
    assert not a.on_append(2, 5, 22)
    a.on_generate(generate(30))
    a.poll(5000)
    assert not a.on_append(1, 5, 31), "fenced session must refuse appends"


def test_lease_expiry_self_fences_but_retains_state():
    a = AgentSession()
    a.on_assign(assign(1, 5, 10), 0)
    a.on_generate(generate(11))
    assert a.emit(1, 100, tokens(1)) is not None

    assert len(a.needs_renew(700)) == 1
    assert a.poll(1500) == [SelfFence(session_id=1)]
    assert a.poll(1600) == [], "a session fences once"
    assert a.emit(1, 100, tokens(2)) is None
    assert a.unacked_events(1, 100) == 1
    assert a.is_fenced(1) is True
    assert a.is_fenced(2) is None


def test_renewal_is_asked_between_renew_by_and_expiry_and_a_grant_restarts_the_lease():
    a = AgentSession()
    a.on_assign(assign(1, 5, 10), 0)
    assert a.needs_renew(599) == []
    assert [(r.session_id, r.epoch) for r in a.needs_renew(600)] == [(1, 5)]
    a.on_lease_grant(LeaseGrantMsg(session_id=1, epoch=4, duration_ms=1000, renew_by_ms=600), 700)
    assert a.needs_renew(700) != [], "a grant for another epoch restarted the lease"
    a.on_lease_grant(LeaseGrantMsg(session_id=1, epoch=5, duration_ms=1000, renew_by_ms=600), 700)
    assert a.needs_renew(700) == []
    assert a.poll(1500) == []
    assert a.poll(1700) == [SelfFence(session_id=1)]
    assert a.needs_renew(1700) == [], "a fenced session asks for nothing"


def test_a_newer_epoch_lifts_the_fence_and_drops_the_older_generations():
    a = AgentSession()
    a.on_assign(assign(1, 5, 10), 0)
    a.on_generate(generate(11))
    a.emit(1, 100, tokens(1))
    a.poll(5000)
    assert a.on_assign(assign(1, 6, 12), 5000)
    assert a.is_fenced(1) is False
    assert a.unacked_events(1, 100) == 0
    assert a.emit(1, 100, tokens(2)) is None
    assert not a.on_generate(generate(13, epoch=5, generation=101))
    assert a.on_generate(generate(13, epoch=6, generation=101))


def test_revoke_forgets_the_session_unless_older():
    a = AgentSession()
    a.on_assign(assign(1, 5, 10), 0)
    a.on_generate(generate(11))
    assert not a.on_revoke(SessionRevokeMsg(command_id=12, session_id=1, epoch=4))
    assert not a.on_revoke(SessionRevokeMsg(command_id=12, session_id=2, epoch=5))
    assert a.on_revoke(SessionRevokeMsg(command_id=12, session_id=1, epoch=5))
    assert a.is_fenced(1) is None
    assert a.emit(1, 100, tokens(1)) is None


def test_watermark_ack_trims_the_retry_buffer_of_its_epoch_only():
    a = AgentSession()
    a.on_assign(assign(1, 5, 10), 0)
    a.on_generate(generate(11))
    for t in range(3):
        a.emit(1, 100, tokens(t))
    a.on_watermark_ack(WatermarkAckMsg(session_id=1, epoch=4, generation_id=100, watermark=2))
    assert a.unacked_events(1, 100) == 3
    a.on_watermark_ack(WatermarkAckMsg(session_id=1, epoch=5, generation_id=100, watermark=1))
    assert a.unacked_events(1, 100) == 1


def reconcile(session=1, epoch=5, command_watermark=0, watermarks=()):
    return ReconcileMsg(
        sessions=[
            SessionReconcileState(
                session_id=session,
                epoch=epoch,
                lease_state=LeaseStateMsg(lease=Lease(duration_ms=9, renew_by_ms=8), elapsed_ms=7),
                command_watermark=command_watermark,
                generation_watermarks=[GenerationWatermark(generation_id=g, watermark=w) for g, w in watermarks],
            )
        ]
    )


def test_reconcile_retransmits_past_the_watermark():
    a = AgentSession()
    a.on_assign(assign(1, 5, 10), 0)
    a.on_generate(generate(11))
    for t in range(4):
        a.emit(1, 100, tokens(t))
    ack, again = a.on_reconcile(reconcile(watermarks=[(100, 1), (999, None)]), 300)
    (s,) = ack.sessions
    assert s.held
    assert [(r.generation_id, r.from_seq, r.to_seq) for r in s.retry_ranges] == [(100, 2, 3)]
    assert s.lease_view.elapsed_ms == 300
    assert [e.event_seq for batch in again for e in batch.events] == [2, 3]
    ack, again = a.on_reconcile(reconcile(watermarks=[(100, None)]), 300)
    assert [e.event_seq for batch in again for e in batch.events] == [0, 1, 2, 3]
    ack, again = a.on_reconcile(reconcile(watermarks=[(100, 3)]), 300)
    assert again == [] and ack.sessions[0].retry_ranges == []


def test_reconcile_trims_commands_below_the_head_watermark():
    a = AgentSession()
    a.on_assign(assign(1, 5, 10), 0)
    assert a.on_append(1, 5, 11)
    a.on_reconcile(reconcile(command_watermark=12), 0)
    # 11 is forgotten (the head will not send it again); 12 may still come and is remembered
    # by nobody yet, so both apply once more.
    assert a.on_append(1, 5, 11)
    assert a.on_append(1, 5, 12)
    assert not a.on_append(1, 5, 12)


def test_reconcile_of_unknown_or_superseded_sessions_is_not_held():
    a = AgentSession()
    ack, again = a.on_reconcile(reconcile(session=9), 0)
    assert not ack.sessions[0].held
    assert ack.sessions[0].lease_view == LeaseStateMsg(lease=Lease(duration_ms=9, renew_by_ms=8), elapsed_ms=7)

    a.on_assign(assign(1, 5, 10), 0)
    a.on_generate(generate(11))
    a.emit(1, 100, tokens(0))
    ack, again = a.on_reconcile(reconcile(epoch=6, watermarks=[(100, None)]), 0)
    assert not ack.sessions[0].held
    assert again == []
    assert a.is_fenced(1) is True
