"""The node agent's side of Link F as a pure state machine: messages and the time in, verdicts
and messages out, no sockets and no clock reads.

``now`` is milliseconds on a monotonic clock of the caller's choosing (the agent's start).
Epochs are absolute: a message from an older epoch is refused, a newer one supersedes. A
command id is applied once; its replay is refused. A session whose lease runs out fences
itself but keeps its state for ``retention_ms`` (``DEFAULT_RETENTION_MS``, five minutes), so a
reconnecting head can still reconcile it and its old commands are still refused as replays;
then it is forgotten, so memory does not grow with every session a node ever held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.idempotency import CommandTable, LeaseClock, RetryBuffer
from proto.linkf import (
    AnyTokenEventPayload,
    GenerateReqMsg,
    Lease,
    LeaseGrantMsg,
    LeaseRenewMsg,
    LeaseStateMsg,
    ReconcileAckMsg,
    ReconcileMsg,
    RetryRange,
    SessionAssignMsg,
    SessionReconcileAck,
    SessionReconcileState,
    SessionRevokeMsg,
    TokenEvent,
    TokenEventPayload,
    TokenEventsMsg,
    WatermarkAckMsg,
)

#: How long a fenced session is remembered: well past the Rust fleet's 120 s lease and a head's
#: reconnect backoff, so a head that comes back reconciles it, and a late replay of one of its
#: commands is still refused.
DEFAULT_RETENTION_MS = 300_000


class AgentAction:
    """What the agent must do that no message asked for (returned by ``AgentSession.poll``)."""


@dataclass(frozen=True)
class SelfFence(AgentAction):
    """The session's lease ran out: stop serving it (its state stays, for the retention time,
    for a reconcile)."""

    session_id: int



@dataclass
class _SessionCtx:
    epoch: int
    clock: LeaseClock
    commands: CommandTable = field(default_factory=CommandTable)
    fenced: bool = False
    #: When (ms) it was fenced; it is forgotten `retention_ms` later.
    fenced_at: int = 0

    def fence(self, now: int) -> None:
        if not self.fenced:
            self.fenced, self.fenced_at = True, now


@dataclass
class _GenerationCtx:
    epoch: int
    next_seq: int = 0
    retry: RetryBuffer = field(default_factory=RetryBuffer)
    #: Tokens in the events ``retry`` holds.
    unacked_tokens: int = 0
    #: Its Finish has been emitted: once the head has acknowledged everything, it is forgotten.
    finished: bool = False


@dataclass(frozen=True)
class Unacked:
    """Events, and the tokens in them, sent and not yet acknowledged."""

    events: int
    tokens: int


def _token_count(event: TokenEvent) -> int:
    return len(event.payload.tokens) if isinstance(event.payload, TokenEventPayload.Tokens) else 0


def _clock(now: int, lease: Lease) -> LeaseClock:
    return LeaseClock(now, lease.duration_ms, lease.renew_by_ms)


class AgentSession:
    """Every session and generation this node holds, across connections."""

    def __init__(self, retention_ms: int = DEFAULT_RETENTION_MS) -> None:
        self.retention_ms = retention_ms
        self._sessions: dict[int, _SessionCtx] = {}
        self._generations: dict[tuple[int, int], _GenerationCtx] = {}

    def on_revoke(self, msg: SessionRevokeMsg) -> bool:
        """Forgets the session unless the revoke is from an older epoch."""
        s = self._sessions.get(msg.session_id)
        if s is None or msg.epoch < s.epoch:
            return False
        del self._sessions[msg.session_id]
        self._drop_generations(msg.session_id, keep_from_epoch=None)
        return True

    def on_assign(self, msg: SessionAssignMsg, now: int) -> bool:
        """Takes the session (again) at ``msg.epoch``; a newer epoch drops the older epochs'
        generations and lifts a fence. Older epochs and replayed commands are refused."""
        s = self._sessions.get(msg.session_id)
        if s is None:
            s = _SessionCtx(msg.epoch, _clock(now, msg.lease))
            s.commands.apply(msg.command_id, tuple)
            self._sessions[msg.session_id] = s
            return True
        if msg.epoch < s.epoch:
            return False
        if not s.commands.apply(msg.command_id, tuple)[1]:
            return False
        if msg.epoch > s.epoch:
            self._drop_generations(msg.session_id, keep_from_epoch=msg.epoch)
        s.epoch = msg.epoch
        s.fenced = False
        s.clock = _clock(now, msg.lease)
        return True

    def on_generate(self, msg: GenerateReqMsg) -> bool:
        """Accepts a generation for a live session at its current epoch, once per command id.
        A replay keeps the generation's stream where it was."""
        s = self._live(msg.session_id, msg.epoch)
        if s is None or not s.commands.apply(msg.command_id, tuple)[1]:
            return False
        self._generations.setdefault((msg.session_id, msg.generation_id), _GenerationCtx(msg.epoch))
        return True

    def on_append(self, session_id: int, epoch: int, command_id: int) -> bool:
        """Whether an APPEND_CONTENT should replace the session's context."""
        s = self._live(session_id, epoch)
        return s is not None and s.commands.apply(command_id, tuple)[1]

    def emit(self, session_id: int, generation_id: int, payload: AnyTokenEventPayload) -> TokenEventsMsg | None:
        """The next event of a generation as a one-event batch, kept for retransmission; None
        when the session is unknown or fenced, or the generation is unknown or superseded."""
        s = self._sessions.get(session_id)
        if s is None or s.fenced:
            return None
        g = self._generations.get((session_id, generation_id))
        if g is None or g.epoch != s.epoch:
            return None
        event = TokenEvent(
            session_id=session_id,
            epoch=g.epoch,
            generation_id=generation_id,
            event_seq=g.next_seq,
            payload=payload,
        )
        g.next_seq += 1
        g.finished = isinstance(payload, TokenEventPayload.Finish)
        g.retry.push(event.event_seq, event)
        g.unacked_tokens += _token_count(event)
        return TokenEventsMsg(events=[event])

    def on_watermark_ack(self, msg: WatermarkAckMsg) -> None:
        """Drops the events the head has committed, and a finished generation once the head
        has committed all of it: nothing of it can be asked for again, and a session that
        lives long would otherwise keep every generation it ever ran."""
        key = (msg.session_id, msg.generation_id)
        g = self._generations.get(key)
        if g is not None and g.epoch == msg.epoch:
            g.unacked_tokens -= sum(map(_token_count, g.retry.ack(msg.watermark)))
            if g.finished and not len(g.retry):
                del self._generations[key]

    def needs_renew(self, now: int) -> list[LeaseRenewMsg]:
        """A renewal for every live session past its renew-by point and not yet expired."""
        return [
            LeaseRenewMsg(session_id=sid, epoch=s.epoch)
            for sid, s in sorted(self._sessions.items())
            if not s.fenced and s.clock.must_renew(now) and not s.clock.expired(now)
        ]

    def next_deadline(self, now: int) -> int | None:
        """The earliest time (ms) at which ``needs_renew`` or ``poll`` may have something new
        to say: a live session's renew-by point not yet reached, or its expiry. None when no
        session is live. A caller may sleep until then."""
        points = [
            s.clock.renew_at() if s.clock.renew_at() > now else s.clock.expires_at()
            for s in self._sessions.values()
            if not s.fenced
        ]
        return min(points, default=None)

    def on_lease_grant(self, msg: LeaseGrantMsg, now: int) -> None:
        """Restarts the lease of a live session; a grant for another epoch is ignored."""
        s = self._sessions.get(msg.session_id)
        if s is not None and s.epoch == msg.epoch and not s.fenced:
            s.clock = LeaseClock(now, msg.duration_ms, msg.renew_by_ms)

    def poll(self, now: int) -> list[AgentAction]:
        """Fences every session whose lease has expired, once, and forgets every session fenced
        for the retention time, with its generations."""
        actions: list[AgentAction] = []
        for sid, s in sorted(self._sessions.items()):
            if not s.fenced and s.clock.expired(now):
                s.fence(now)
                actions.append(SelfFence(session_id=sid))
        gone = {sid for sid, s in self._sessions.items() if s.fenced and now - s.fenced_at >= self.retention_ms}
        if gone:
            # New dicts rather than deletions: a dict never shrinks its table by itself.
            self._sessions = {sid: s for sid, s in self._sessions.items() if sid not in gone}
            self._generations = {k: g for k, g in self._generations.items() if k[0] not in gone}
        return actions

    def on_reconcile(self, msg: ReconcileMsg, now: int) -> tuple[ReconcileAckMsg, list[TokenEventsMsg]]:
        """Answers a reconnecting head: which sessions this node still holds at the head's
        epoch, and the events past each generation's watermark, to send again."""
        acks: list[SessionReconcileAck] = []
        retransmissions: list[TokenEventsMsg] = []
        for head_state in msg.sessions:
            s = self._sessions.get(head_state.session_id)
            if s is None:
                acks.append(
                    SessionReconcileAck(
                        session_id=head_state.session_id,
                        held=False,
                        retry_ranges=[],
                        lease_view=head_state.lease_state,
                    )
                )
                continue
            if head_state.epoch > s.epoch:
                s.fence(now)
            s.commands.trim(max(head_state.command_watermark - 1, 0))
            held = head_state.epoch == s.epoch and not s.fenced
            ranges = self._retransmit(head_state, retransmissions) if held else []
            acks.append(
                SessionReconcileAck(
                    session_id=head_state.session_id,
                    held=held,
                    retry_ranges=ranges,
                    lease_view=LeaseStateMsg(lease=Lease(duration_ms=0, renew_by_ms=0), elapsed_ms=now),
                )
            )
        return ReconcileAckMsg(sessions=acks), retransmissions

    def is_fenced(self, session_id: int) -> bool | None:
        """None for a session this node does not know."""
        s = self._sessions.get(session_id)
        return None if s is None else s.fenced

    def unacked_events(self, session_id: int, generation_id: int) -> int:
        g = self._generations.get((session_id, generation_id))
        return 0 if g is None else len(g.retry)

    def unacked(self, session_id: int, generation_id: int) -> Unacked:
        """What the head has not acknowledged of a generation: a sender's flow-control window."""
        g = self._generations.get((session_id, generation_id))
        return Unacked(0, 0) if g is None else Unacked(len(g.retry), g.unacked_tokens)

    def _live(self, session_id: int, epoch: int) -> _SessionCtx | None:
        """The session, when it is held at exactly ``epoch`` and not fenced."""
        s = self._sessions.get(session_id)
        if s is None or s.epoch != epoch or s.fenced:
            return None
        return s

    def _drop_generations(self, session_id: int, keep_from_epoch: int | None) -> None:
        """Drops the session's generations, but those at ``keep_from_epoch`` or newer."""
        self._generations = {
            k: g
            for k, g in self._generations.items()
            if k[0] != session_id or (keep_from_epoch is not None and g.epoch >= keep_from_epoch)
        }

    def _retransmit(self, head_state: SessionReconcileState, out: list[TokenEventsMsg]) -> list[RetryRange]:
        """Appends to ``out`` the unacknowledged tail of each generation the head names."""
        ranges: list[RetryRange] = []
        for gw in head_state.generation_watermarks:
            g = self._generations.get((head_state.session_id, gw.generation_id))
            if g is None:
                continue
            tail = g.retry.retransmit_from(0 if gw.watermark is None else gw.watermark + 1)
            if tail:
                ranges.append(
                    RetryRange(
                        generation_id=gw.generation_id,
                        from_seq=tail[0].event_seq,
                        to_seq=tail[-1].event_seq,
                    )
                )
                out.append(TokenEventsMsg(events=tail))
        return ranges
