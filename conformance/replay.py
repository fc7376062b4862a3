"""Replays the head's side of a transcript to a node and lists how its answers differ.

The head's frames go out byte for byte (HELLO with the replaying side's token, since the
transcript holds none), each once the node has answered everything the recording shows before
it, or the wait runs out. The node's answers are then compared by what they mean, not how they
were cut or timed: per generation its tokens and finish reason (not how they were split into
events), the fixed figures of HELLO_ACK_F and NODE_STATUS (not load, rates or clocks), every
RECONCILE_ACK (less its clock), stage answers by request id, the leases it asked to renew.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from conformance.raw import RawLink
from linkf.errors import Closed
from linkf.transcript import HEAD, Transcript
from proto import postcard
from proto.envelope import Frame, FrameClass, encode_frame
from proto.handshake import CapacitySummary, Hello
from proto.linkf import SessionReconcileAck, TokenEventPayload, decode_payload, msg_type

#: Frames whose coming and going is a matter of time alone.
IGNORED = {msg_type.KEEPALIVE, msg_type.TELEMETRY}
#: How long the node may go on answering after the head's last frame.
SETTLE_S = 0.3


@dataclass(frozen=True)
class Difference:
    what: str
    recorded: object
    replayed: object

    def __str__(self) -> str:
        return f"{self.what}: recorded {self.recorded!r}, replayed {self.replayed!r}"


def fixed(c: CapacitySummary) -> dict:
    """The capacity figures that do not move with load or time."""
    return {
        "max_sessions": c.max_sessions,
        "max_context_tokens": c.max_context_tokens,
        "kv_blocks_total": c.kv_blocks_total,
        "max_lanes": c.max_lanes,
    }


def timeless(s: SessionReconcileAck) -> SessionReconcileAck:
    """A session's RECONCILE_ACK less its clock (`lease_view.elapsed_ms`)."""
    return dataclasses.replace(s, lease_view=dataclasses.replace(s.lease_view, elapsed_ms=0))


@dataclass
class Answers:
    """What one node said on one link, reduced to what must repeat."""

    hello: dict | None = None
    #: (session, epoch, generation) -> event_seq -> payload; a retransmission lands on its seq.
    events: dict[tuple[int, int, int], dict[int, Any]] = field(default_factory=dict)
    reconcile: list = field(default_factory=list)
    stage: dict[int, tuple] = field(default_factory=dict)
    renewals: set[tuple[int, int]] = field(default_factory=set)
    status: list[dict] = field(default_factory=list)
    other: list[tuple[int, bytes]] = field(default_factory=list)

    def add(self, t: int, payload: bytes) -> None:
        if t in IGNORED:
            return
        try:
            msg = decode_payload(t, payload)
        except postcard.PostcardError:
            self.other.append((t, payload))
            return
        if t == msg_type.HELLO_ACK_F:
            self.hello = {
                "chosen_version": msg.chosen_version,
                "node_identity": msg.node_identity,
                "loadable_models": msg.loadable_models,
                "feature_flags": msg.feature_flags,
                "limits": msg.limits,
                **fixed(msg.capacity),
            }
        elif t == msg_type.TOKEN_EVENTS:
            for e in msg.events:
                self.events.setdefault((e.session_id, e.epoch, e.generation_id), {})[e.event_seq] = e.payload
        elif t == msg_type.RECONCILE_ACK:
            self.reconcile.append([timeless(s) for s in msg.sessions])
        elif t == msg_type.STAGE_FORWARD_RESP:
            self.stage[msg.request_id] = (msg.hidden, msg.token)
        elif t == msg_type.LEASE_RENEW:
            self.renewals.add((msg.session_id, msg.epoch))
        elif t == msg_type.NODE_STATUS:
            status = {"loadable_models": msg.loadable_models, **fixed(msg.capacity)}
            if status not in self.status:
                self.status.append(status)
        else:
            self.other.append((t, payload))

    def tokens(self, key) -> list[int]:
        events = self.events.get(key, {})
        return [t for seq in sorted(events) if isinstance(events[seq], TokenEventPayload.Tokens)
                for t in events[seq].tokens]

    def finish(self, key) -> int | None:
        payloads = self.events.get(key, {}).values()
        return next((p.reason for p in payloads if isinstance(p, TokenEventPayload.Finish)), None)

    def covers(self, want: Answers) -> bool:
        """Whether everything `want` holds that a head waits for has come here too."""
        return (
            (want.hello is None or self.hello is not None)
            and all(len(self.tokens(k)) >= len(want.tokens(k)) for k in want.events)
            and all(self.finish(k) is not None for k in want.events if want.finish(k) is not None)
            and len(self.reconcile) >= len(want.reconcile)
            and set(want.stage) <= set(self.stage)
        )


def compare(recorded: Answers, replayed: Answers) -> list[Difference]:
    out = []
    for name in (recorded.hello or {}).keys() | (replayed.hello or {}).keys():
        a, b = (recorded.hello or {}).get(name), (replayed.hello or {}).get(name)
        if a != b:
            out.append(Difference(f"HELLO_ACK_F {name}", a, b))
    for key in sorted(recorded.events.keys() | replayed.events.keys()):
        where = "session {} epoch {} generation {}".format(*key)
        if recorded.tokens(key) != replayed.tokens(key):
            out.append(Difference(f"{where} tokens", recorded.tokens(key), replayed.tokens(key)))
        if recorded.finish(key) != replayed.finish(key):
            out.append(Difference(f"{where} finish reason", recorded.finish(key), replayed.finish(key)))
    if recorded.reconcile != replayed.reconcile:
        out.append(Difference("RECONCILE_ACK", recorded.reconcile, replayed.reconcile))
    for rid in sorted(recorded.stage.keys() | replayed.stage.keys()):
        if recorded.stage.get(rid) != replayed.stage.get(rid):
            out.append(Difference(f"STAGE_FORWARD_RESP {rid}", recorded.stage.get(rid), replayed.stage.get(rid)))
    if recorded.renewals != replayed.renewals:
        out.append(Difference("LEASE_RENEW for (session, epoch)", sorted(recorded.renewals), sorted(replayed.renewals)))
    if recorded.status and replayed.status and recorded.status != replayed.status:
        out.append(Difference("NODE_STATUS fixed figures", recorded.status, replayed.status))
    if recorded.other != replayed.other:
        out.append(Difference("other frames", recorded.other, replayed.other))
    return out


def replay(t: Transcript, addr: str, auth: bytes = b"", timeout: float = 10.0) -> list[Difference]:
    """Plays `t`'s head side to the node at `addr`; every difference in what it answered."""
    recorded, replayed = Answers(), Answers()
    notes: list[Difference] = []
    with RawLink.connect(addr, auth, timeout=timeout) as link:
        for r in t.records:
            if r.sender != HEAD:
                recorded.add(r.msg_type, r.payload)
                continue
            if not _await(link, replayed, recorded, timeout):
                notes.append(Difference(f"the link before the head's frame #{r.seq}", "open", "closed by the node"))
                return notes + compare(recorded, replayed)
            payload = _with_token(r.payload, auth) if r.redacted else r.payload
            link.send(encode_frame(Frame(r.version, r.msg_type, r.seq, 0, FrameClass.for_type(r.msg_type), payload)))
        if _await(link, replayed, recorded, timeout):
            _settle(link, replayed)
    return notes + compare(recorded, replayed)


def _with_token(payload: bytes, auth: bytes) -> bytes:
    hello = postcard.from_bytes(Hello, payload)
    return postcard.to_bytes(dataclasses.replace(hello, auth=bytes(auth)))


def _await(link: RawLink, got: Answers, want: Answers, timeout: float) -> bool:
    """Reads until `got` covers `want` or `timeout` passes; False once the node hung up."""
    deadline = time.monotonic() + timeout
    while not got.covers(want) and time.monotonic() < deadline:
        if not _read_for(link, got, deadline - time.monotonic()):
            return False
    return True


def _settle(link: RawLink, got: Answers) -> None:
    """Reads what the node still says within `SETTLE_S`."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and _read_for(link, got, deadline - time.monotonic()):
        pass


def _read_for(link: RawLink, got: Answers, seconds: float) -> bool:
    """One read of at most `seconds`; False once the node hung up."""
    try:
        for frame in link.read(seconds):
            got.add(frame.msg_type, frame.payload)
    except Closed:
        return False
    return True
