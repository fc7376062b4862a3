"""A head client: drives any node (ours or the Rust one) over a real Link F connection.

`FleetHead.connect` dials a node (Noise when given a token), says HELLO as a head and keeps a
`linkf.head.HeadSession` for the link, as the Rust `FleetHead` does. Every frame it reads goes
through one place: token events are committed (into `wal`) and acknowledged, lease renewals
granted (unless `grant_renewals` is off), and everything is recorded with the time it came, so
a check can look at what the node sent and when.

Unlike the Rust head, every wait is bounded: a node that stays connected but never answers is a
`HeadTimeout` naming what was awaited, never a hang.

Nothing is shared between heads: each numbers its own epochs and command ids, starting from the
wall clock in microseconds, so a later head (in this process or the next) places a session
above any epoch and command an earlier one used: a node remembers sessions across connections.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from conformance.wal import WalStub
from linkf.driver import Endpoint, Liveness
from linkf.errors import Closed
from linkf.head import HeadSession
from linkf.message import Message
from proto import finish
from proto.envelope import Frame
from proto.fleet import encode_params, encode_tokens
from proto.handshake import HelloAckF, LinkRole
from proto.linkf import (
    GenerateCancelMsg,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    Lease,
    ReconcileAckMsg,
    StageForwardReqMsg,
    StageForwardRespMsg,
    TokenEvent,
    TokenEventPayload,
    TokenEventsMsg,
    msg_type,
    type_name,
)
from proto.params import GenParams

#: The lease the Rust fleet tests place sessions with.
LEASE = Lease(duration_ms=120_000, renew_by_ms=90_000)
#: Sampling off: what a session gets unless told otherwise.
GREEDY = GenParams()
#: Seconds a helper waits for the node by default.
TIMEOUT = 10.0
#: The head's KEEPALIVE interval on a version-3 link, as the Rust head's.
HEARTBEAT = 5.0


def reason(code: int | None) -> str:
    """A finish code's name, for a person: `LENGTH`, `DECLINED`."""
    return "no Finish" if code is None else finish.name(code).upper()


class HeadTimeout(Exception):
    """The node did not send what the head waited for within the time it waits."""


class NotPlaced(ValueError):
    """A command for a session this head has not placed (or has revoked): a caller's mistake."""


M = TypeVar("M")


def placed(msg: M | None, session_id: int) -> M:
    """`msg`, which `HeadSession` builds only for a session it holds."""
    if msg is None:
        raise NotPlaced(f"session {session_id} is not placed by this head")
    return msg


@dataclass
class Generation:
    """What one generation sent: its tokens in order, its finish reason, and the raw events."""

    session_id: int
    generation_id: int
    tokens: list[int] = field(default_factory=list)
    finish: int | None = None
    #: Every event received for it, retransmissions and repeats included.
    events: list[TokenEvent] = field(default_factory=list)
    #: (epoch, event_seq) of the events counted in `tokens` and `finish`.
    seen: set[tuple[int, int]] = field(default_factory=set)


@dataclass(frozen=True)
class Received:
    """A frame the head read, its decoded payload and when (time.monotonic())."""

    at: float
    frame: Frame
    #: The payload, decoded as its type says (a `TokenEventsMsg`, a `NodeStatusMsg`, ...).
    msg: Any


@dataclass(frozen=True)
class Dial:
    """How a head reaches its node, kept for reconnecting."""

    addr: str
    auth: bytes
    noise: bool
    versions: tuple[int, int]
    role: LinkRole
    heartbeat: float

    def open(self, timeout: float) -> tuple[Endpoint, HelloAckF]:
        """A link past HELLO; the node's HELLO_ACK_F."""
        if self.noise:
            endpoint = Endpoint.connect_tcp_secure(self.addr, self.auth, timeout, timeout)
        else:
            endpoint = Endpoint.connect_tcp(self.addr, timeout)
        try:
            node = endpoint.hello_as_head(self.auth, timeout, versions=self.versions, role=self.role)
        except BaseException:
            endpoint.close()
            raise
        endpoint.keep_alive(Liveness(heartbeat=self.heartbeat, silence=0.0))
        return endpoint, node


def clock_id() -> int:
    """Microseconds since the Unix epoch: a start for ids that a later head must exceed."""
    return time.time_ns() // 1000


class FleetHead:
    """One head connection to one node."""

    def __init__(self, endpoint: Endpoint, node: HelloAckF, dial: Dial, first_epoch: int, first_command: int) -> None:
        self.endpoint = endpoint
        self.node = node
        self.dial = dial
        self.wal = WalStub()
        self.session = HeadSession.starting_at(first_command, self.wal.commit)
        self._epochs = itertools.count(first_epoch)
        #: Generation ids and stage request ids come from one counter, as the Rust head's.
        self._ids = itertools.count(1)
        self.grant_renewals = True
        #: While True, token events are recorded but neither committed nor acknowledged, as
        #: if they were lost on the way.
        self.lose_events = False
        self.received: list[Received] = []
        self.generations: dict[tuple[int, int], Generation] = {}
        self.stage_answers: dict[int, StageForwardRespMsg] = {}
        #: The highest watermark acknowledged per (session, epoch, generation), across links.
        self.acked: dict[tuple[int, int, int], int] = {}

    # ---- connecting -----------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        addr: str,
        *,
        auth: bytes = b"",
        noise: bool | None = None,
        versions: tuple[int, int] = (2, 3),
        role: LinkRole = LinkRole.HeadDaemon,
        timeout: float = 5.0,
        heartbeat: float = HEARTBEAT,
        first_epoch: int | None = None,
        first_command: int | None = None,
    ) -> FleetHead:
        """Dials `addr` and says HELLO with `auth`; the link is Noise keyed by `auth` when there
        is one, unless `noise=False`. Epochs and command ids start from the clock unless given."""
        dial = Dial(addr, bytes(auth), bool(auth) if noise is None else noise, versions, role, heartbeat)
        endpoint, node = dial.open(timeout)
        start = clock_id()
        return cls(
            endpoint,
            node,
            dial,
            start if first_epoch is None else first_epoch,
            start * 16 if first_command is None else first_command,
        )

    def reconnect(self, timeout: float = TIMEOUT) -> ReconcileAckMsg:
        """Drops this connection, dials again and reconciles, as the Rust head does: RECONCILE
        first, then the RECONCILE_ACK and every event it says is being sent again. (The Rust
        head then sends each held session's content again and places the others anew; a caller
        does what it needs of that itself.)"""
        self.endpoint.close()
        self.endpoint, self.node = self.dial.open(timeout)
        start = len(self.received)
        self.endpoint.send(msg_type.RECONCILE, self.session.reconcile())
        ack = self.wait_for(msg_type.RECONCILE_ACK, timeout).msg
        owed = {
            (s.session_id, r.generation_id, seq)
            for s in ack.sessions
            for r in s.retry_ranges
            for seq in range(r.from_seq, r.to_seq + 1)
        }
        self.until(lambda: owed <= self._events_since(start), timeout, "the retransmitted events")
        return ack

    def close(self) -> None:
        self.endpoint.close()

    def __enter__(self) -> FleetHead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- commands -------------------------------------------------------------------------

    def assign(
        self,
        session_id: int,
        params: GenParams = GREEDY,
        lease: Lease = LEASE,
        *,
        qos_class: int = 0,
        codec: str = "mock",
    ) -> int:
        """Places the session at a fresh epoch; returns the epoch."""
        epoch = next(self._epochs)
        msg = self.session.assign_session(session_id, epoch, lease, qos_class, codec, encode_params(params))
        self.endpoint.send(msg_type.SESSION_ASSIGN, msg)
        return epoch

    def append(self, session_id: int, tokens: list[int]) -> None:
        """Replaces the session's whole context on the node."""
        msg = placed(self.session.append_content(session_id, encode_tokens(tokens)), session_id)
        self.endpoint.send(msg_type.APPEND_CONTENT, msg)

    def revoke(self, session_id: int) -> None:
        self.endpoint.send(msg_type.SESSION_REVOKE, placed(self.session.revoke(session_id), session_id))

    def next_id(self) -> int:
        """A fresh generation or stage request id."""
        return next(self._ids)

    def request(self, session_id: int, max_new: int, max_wall_ms: int = 60_000) -> GenerateReqMsg:
        """Sends a GENERATE_REQ for a fresh generation id and returns it (to replay or collect)."""
        budgets = GenerationBudgetsMsg(max_new_tokens=max_new, max_wall_ms=max_wall_ms)
        req = placed(self.session.generate(session_id, self.next_id(), budgets), session_id)
        self.endpoint.send(msg_type.GENERATE_REQ, req)
        return req

    def collect(self, req: GenerateReqMsg, timeout: float = TIMEOUT) -> Generation:
        """Waits for the generation's Finish; returns everything it sent."""
        key = (req.session_id, req.generation_id)
        self.until(lambda: self.finished(key), timeout, f"Finish for session {key[0]} generation {key[1]}")
        self.session.retire_generation(*key)
        return self.generations[key]

    def generate(
        self, session_id: int, max_new: int, max_wall_ms: int = 60_000, timeout: float = TIMEOUT
    ) -> Generation:
        return self.collect(self.request(session_id, max_new, max_wall_ms), timeout)

    def stream(self, req: GenerateReqMsg, timeout: float = TIMEOUT) -> Iterator[list[int]]:
        """Yields each run of new tokens of `req`'s generation as it arrives, until its Finish
        (then `generations[...]` holds it); `timeout` bounds each wait for more."""
        key = (req.session_id, req.generation_id)
        given = 0
        while True:
            g = self.generations.get(key)
            if g is not None and len(g.tokens) > given:
                yield g.tokens[given:]
                given = len(g.tokens)
            elif g is not None and g.finish is not None:
                self.session.retire_generation(*key)
                return
            else:
                self.until(
                    functools.partial(self._progressed, key, given),
                    timeout,
                    f"tokens or a Finish for session {key[0]} generation {key[1]}",
                )

    def generate_streaming(
        self, session_id: int, max_new: int, max_wall_ms: int = 60_000, timeout: float = TIMEOUT
    ) -> Iterator[list[int]]:
        return self.stream(self.request(session_id, max_new, max_wall_ms), timeout)

    def cancel(self, req: GenerateReqMsg) -> None:
        msg = GenerateCancelMsg(session_id=req.session_id, generation_id=req.generation_id)
        self.endpoint.send(msg_type.GENERATE_CANCEL, msg)

    def send_stage(self, tokens: list[int], start: int, end: int, hidden_in: bytes | None = None) -> int:
        """Sends a STAGE_FORWARD_REQ; returns its request id."""
        request_id = self.next_id()
        msg = StageForwardReqMsg(
            request_id=request_id, tokens=tokens, start_layer=start, end_layer=end, hidden_in=hidden_in
        )
        self.endpoint.send(msg_type.STAGE_FORWARD_REQ, msg)
        return request_id

    def stage_answer(self, request_id: int, timeout: float = TIMEOUT) -> StageForwardRespMsg:
        self.until(lambda: request_id in self.stage_answers, timeout, f"stage answer {request_id}")
        return self.stage_answers[request_id]

    def stage(self, tokens: list[int], start: int, end: int, hidden_in: bytes | None = None, timeout: float = TIMEOUT):
        """A stage forward over layers [start, end), answered (forward_stage)."""
        return self.stage_answer(self.send_stage(tokens, start, end, hidden_in), timeout)

    def keepalive(self) -> None:
        self.endpoint.send(msg_type.KEEPALIVE)

    # ---- reading --------------------------------------------------------------------------

    def finished(self, key: tuple[int, int]) -> bool:
        g = self.generations.get(key)
        return g is not None and g.finish is not None

    def _progressed(self, key: tuple[int, int], given: int) -> bool:
        """Whether the generation finished or has more than `given` tokens."""
        g = self.generations.get(key)
        return g is not None and (g.finish is not None or len(g.tokens) > given)

    def pump(self) -> list[Received]:
        """One read of the link; every frame it brought, handled."""
        return [self.handle(message) for message in self.endpoint.pump()]

    def until(self, done: Callable[[], object], timeout: float, what: str) -> None:
        """Reads the link until `done()` holds; HeadTimeout naming `what` after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() >= deadline:
                raise HeadTimeout(f"no {what} from the node within {timeout:g} s")
            self.pump()

    def idle(self, seconds: float) -> None:
        """Reads (and answers) whatever the node sends for `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.pump()

    def wait_for(self, wanted: int, timeout: float = TIMEOUT) -> Received:
        """The next frame of type `wanted` read from now on."""
        start = len(self.received)
        self.until(
            lambda: any(r.frame.msg_type == wanted for r in self.received[start:]), timeout, type_name(wanted)
        )
        return next(r for r in self.received[start:] if r.frame.msg_type == wanted)

    def of_type(self, wanted: int) -> list[Received]:
        return [r for r in self.received if r.frame.msg_type == wanted]

    def closed_by_node(self, timeout: float) -> bool:
        """Whether the node hangs up within `timeout` (the link reads as Closed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.pump()
            except Closed:
                return True
        return False

    def handle(self, message: Message) -> Received:
        """Keeps and acts on `message` (from `pump`, or from a reader of its own that runs many
        links at once); a head reads every payload, so one that does not decode is `Payload`
        here, whatever its type."""
        msg = message.msg
        got = Received(time.monotonic(), message, msg)
        self.received.append(got)
        if message.msg_type == msg_type.TOKEN_EVENTS:
            self._on_events(msg)
        elif message.msg_type == msg_type.LEASE_RENEW and self.grant_renewals:
            grant = self.session.on_lease_renew(msg)
            if grant is not None:
                self.endpoint.send(msg_type.LEASE_GRANT, grant)
        elif message.msg_type == msg_type.STAGE_FORWARD_RESP:
            self.stage_answers[msg.request_id] = msg
        return got

    def _on_events(self, msg: TokenEventsMsg) -> None:
        for ev in msg.events:
            g = self.generations.setdefault(
                (ev.session_id, ev.generation_id), Generation(ev.session_id, ev.generation_id)
            )
            g.events.append(ev)
            if (ev.epoch, ev.event_seq) in g.seen:
                continue
            g.seen.add((ev.epoch, ev.event_seq))
            if isinstance(ev.payload, TokenEventPayload.Tokens):
                g.tokens.extend(ev.payload.tokens)
            elif isinstance(ev.payload, TokenEventPayload.Finish) and g.finish is None:
                g.finish = ev.payload.reason
        if self.lose_events:
            return
        for ack in self.session.on_token_events(msg):
            self.endpoint.send(msg_type.WATERMARK_ACK, ack)
            key = (ack.session_id, ack.epoch, ack.generation_id)
            self.acked[key] = max(self.acked.get(key, -1), ack.watermark)

    def _events_since(self, start: int) -> set[tuple[int, int, int]]:
        return {
            (e.session_id, e.generation_id, e.event_seq)
            for r in self.received[start:]
            if r.frame.msg_type == msg_type.TOKEN_EVENTS
            for e in r.msg.events
        }
