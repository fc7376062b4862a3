"""The head daemon's side of Link F as a pure state machine, as the Rust head runs it: it
numbers commands, issues epochs, commits token events exactly once (handing each to the
caller's ``commit``, the head's write-ahead log) and acknowledges them, and rebuilds a node's
view with RECONCILE after a reconnect.

The message builders here are what a head (the conformance kit's ``FleetHead``) sends over an
``Endpoint``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proto.idempotency import DedupOutcome, EventDedup, Gap, GenerationKey
from proto.linkf import (
    AppendContentMsg,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    GenerationWatermark,
    Lease,
    LeaseGrantMsg,
    LeaseRenewMsg,
    LeaseStateMsg,
    ReconcileAckMsg,
    ReconcileMsg,
    SessionAssignMsg,
    SessionReconcileState,
    SessionRevokeMsg,
    TokenEvent,
    TokenEventsMsg,
    WatermarkAckMsg,
)


@dataclass
class _SessionState:
    epoch: int
    lease: Lease
    command_watermark: int = 0


class HeadSession:
    """One head's sessions on one node."""

    def __init__(self, first_command: int = 1, commit: Callable[[TokenEvent], object] | None = None) -> None:
        """``commit`` gets every event accepted into its stream, exactly once and in order."""
        self._sessions: dict[int, _SessionState] = {}
        self._generations: set[tuple[int, int, int]] = set()
        self._issued: dict[tuple[int, int], GenerateReqMsg] = {}
        self._dedup = EventDedup()
        self._commit = commit if commit is not None else _discard
        self._next_command = max(first_command, 1)

    @classmethod
    def starting_at(cls, first_command: int, commit: Callable[[TokenEvent], object] | None = None) -> HeadSession:
        """A head whose command ids start at ``first_command``, so a reconnecting head keeps
        them above its earlier connection's: a node remembers commands across connections."""
        return cls(first_command, commit)

    def next_command(self, session_id: int) -> int:
        """A fresh command id; it becomes the session's command watermark."""
        command_id = self._next_command
        self._next_command += 1
        s = self._sessions.get(session_id)
        if s is not None:
            s.command_watermark = command_id
        return command_id

    def assign_session(
        self,
        session_id: int,
        epoch: int,
        lease: Lease,
        qos_class: int = 0,
        codec: str = "chatml",
        params: bytes = b"",
    ) -> SessionAssignMsg:
        """Places the session at ``epoch``; from now on older epochs' events never commit."""
        self._sessions[session_id] = _SessionState(epoch, lease)
        self._dedup.set_session_epoch(session_id, epoch)
        self._issued = {k: m for k, m in self._issued.items() if k[0] != session_id or m.epoch >= epoch}
        return SessionAssignMsg(
            command_id=self.next_command(session_id),
            session_id=session_id,
            epoch=epoch,
            lease=lease,
            codec=codec,
            params=params,
            qos_class=qos_class,
            policy_ref=0,
        )

    def revoke(self, session_id: int) -> SessionRevokeMsg | None:
        s = self._sessions.get(session_id)
        if s is None:
            return None
        command_id = self.next_command(session_id)
        del self._sessions[session_id]
        self._generations = {k for k in self._generations if k[0] != session_id}
        self._issued = {k: m for k, m in self._issued.items() if k[0] != session_id}
        self._dedup.set_session_epoch(session_id, s.epoch)
        return SessionRevokeMsg(command_id=command_id, session_id=session_id, epoch=s.epoch)

    def append_content(self, session_id: int, blocks: bytes) -> AppendContentMsg | None:
        """Replaces the node's context of the session with ``blocks`` (postcard ``Vec<u32>``)."""
        s = self._sessions.get(session_id)
        if s is None:
            return None
        return AppendContentMsg(
            command_id=self.next_command(session_id),
            session_id=session_id,
            epoch=s.epoch,
            blocks=blocks,
            spans=[],
            media_refs=[],
        )

    def generate(
        self, session_id: int, generation_id: int, budgets: GenerationBudgetsMsg
    ) -> GenerateReqMsg | None:
        """The request for a generation; asking again for the same one returns the same
        command id, so a retried request is a replay the node refuses, not a restart."""
        s = self._sessions.get(session_id)
        if s is None:
            return None
        issued = self._issued.get((session_id, generation_id))
        if issued is not None:
            return issued
        msg = GenerateReqMsg(
            command_id=self.next_command(session_id),
            session_id=session_id,
            epoch=s.epoch,
            generation_id=generation_id,
            budgets=budgets,
            policy_ref=0,
        )
        self._issued[(session_id, generation_id)] = msg
        self._generations.add((session_id, s.epoch, generation_id))
        return msg

    def on_token_events(self, msg: TokenEventsMsg) -> list[WatermarkAckMsg]:
        """Commits the events that are next in their stream, and acknowledges every generation
        the batch touched, retransmissions included (their first ack may have been lost).
        Stale epochs and events past a gap commit nothing and are not acknowledged."""
        touched: set[GenerationKey] = set()
        for ev in msg.events:
            key = GenerationKey(ev.session_id, ev.epoch, ev.generation_id)
            try:
                outcome = self._dedup.accept(key, ev.event_seq)
            except Gap:
                continue
            if outcome is DedupOutcome.Accepted:
                self._commit(ev)
                self._generations.add((key.session_id, key.epoch, key.generation_id))
            if outcome is not DedupOutcome.StaleEpoch:
                touched.add(key)
        acks = []
        for key in sorted(touched):
            watermark = self._dedup.watermark(key)
            if watermark is not None:
                acks.append(
                    WatermarkAckMsg(
                        session_id=key.session_id,
                        epoch=key.epoch,
                        generation_id=key.generation_id,
                        watermark=watermark,
                    )
                )
        return acks

    def on_lease_renew(self, msg: LeaseRenewMsg) -> LeaseGrantMsg | None:
        """A grant of the session's lease; None for a session or epoch the head no longer has."""
        s = self._sessions.get(msg.session_id)
        if s is None or s.epoch != msg.epoch:
            return None
        return LeaseGrantMsg(
            session_id=msg.session_id,
            epoch=s.epoch,
            duration_ms=s.lease.duration_ms,
            renew_by_ms=s.lease.renew_by_ms,
        )

    def reconcile(self) -> ReconcileMsg:
        """What a reconnecting head tells the node: each session's epoch, command watermark
        and, per generation of that epoch, the last event committed."""
        sessions = []
        for sid, s in sorted(self._sessions.items()):
            watermarks = [
                GenerationWatermark(
                    generation_id=g,
                    watermark=self._dedup.watermark(GenerationKey(sid, e, g)),
                )
                for (ks, e, g) in sorted(self._generations)
                if ks == sid and e == s.epoch
            ]
            sessions.append(
                SessionReconcileState(
                    session_id=sid,
                    epoch=s.epoch,
                    lease_state=LeaseStateMsg(lease=s.lease, elapsed_ms=0),
                    command_watermark=s.command_watermark,
                    generation_watermarks=watermarks,
                )
            )
        return ReconcileMsg(sessions=sessions)

    def on_reconcile_ack(self, ack: ReconcileAckMsg) -> list[int]:
        """The sessions the node no longer holds: the head must place them again."""
        return [s.session_id for s in ack.sessions if not s.held]

    def retire_generation(self, session_id: int, generation_id: int) -> None:
        """Forgets a finished generation, bounding what the head tracks."""
        s = self._sessions.get(session_id)
        if s is None:
            return
        self._dedup.retire_generation(GenerationKey(session_id, s.epoch, generation_id))
        self._generations.discard((session_id, s.epoch, generation_id))
        self._issued.pop((session_id, generation_id), None)

    def current_epoch(self, session_id: int) -> int | None:
        s = self._sessions.get(session_id)
        return None if s is None else s.epoch


def _discard(event: TokenEvent) -> None:
    """The ``commit`` of a head that keeps no log."""
