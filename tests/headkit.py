"""A small test head: drives a node agent over a real Link F connection.

`Head.connect` dials a node over loopback TCP (Noise when given a token), says HELLO as a head
and keeps a `linkf.head.HeadSession` for the connection, as the Rust `FleetHead` does. Its
helpers block until the node answers or a timeout passes (`HeadTimeout`), and every frame they
read goes through one place: token events are committed and acknowledged, lease renewals are
granted (unless `grant_renewals` is off), NODE_STATUS and the rest are recorded with the time
they came, so a test can assert on what the node sent and when.

Epochs are numbered across every head of the process and each connection's command ids start
2^32 above the previous one's, as the Rust head numbers them: a node remembers sessions across
connections.
"""

from __future__ import annotations

import itertools
import socket
import struct
import time
from dataclasses import dataclass, field

import xxhash

from linkf.driver import Endpoint, Liveness
from linkf.errors import LinkFError
from linkf.head import HeadSession
from nodeagent.fleet import encode_params, encode_tokens
from nodeagent.wal import GenParams
from proto.envelope import Frame
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
    decode_payload,
    msg_type,
)

#: The lease the Rust fleet tests place sessions with.
LEASE = Lease(duration_ms=120_000, renew_by_ms=90_000)
TIMEOUT = 10.0

_epochs = itertools.count(1)
_commands = itertools.count(1, 1 << 32)


class HeadTimeout(AssertionError):
    """The node did not answer within the time a helper waits."""


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
    msg: object


class Head:
    """One head connection to one node."""

    def __init__(self, endpoint: Endpoint, node: HelloAckF, addr, auth: bytes, noise: bool, versions, heartbeat) -> None:
        self.endpoint = endpoint
        self.node = node
        self.addr = addr
        self.auth = auth
        self.noise = noise
        self.versions = versions
        self.heartbeat = heartbeat
        self.session = HeadSession.starting_at(next(_commands))
        #: Generation ids and stage request ids come from one counter, as the Rust head's.
        self._ids = itertools.count(1)
        self.grant_renewals = True
        #: While True, token events are recorded but neither committed nor acknowledged, as
        #: if they were lost on the way.
        self.lose_events = False
        self.received: list[Received] = []
        self.generations: dict[tuple[int, int], Generation] = {}
        self.stage_answers: dict[int, StageForwardRespMsg] = {}

    # ---- connecting -----------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        addr,
        *,
        auth: bytes = b"",
        noise: bool | None = None,
        versions: tuple[int, int] = (2, 3),
        role: LinkRole = LinkRole.HeadDaemon,
        timeout: float = 5.0,
        heartbeat: float = 5.0,
    ) -> Head:
        """Dials `addr` and says HELLO with `auth`; the link is Noise keyed by `auth` when there
        is one, unless `noise=False`. `heartbeat`: the head's KEEPALIVE interval on a v3 link."""
        noise = bool(auth) if noise is None else noise
        endpoint, node = _open(addr, auth, noise, versions, role, timeout, heartbeat)
        return cls(endpoint, node, addr, auth, noise, versions, heartbeat)

    def reconnect(self, timeout: float = TIMEOUT) -> ReconcileAckMsg:
        """Drops this connection, dials again and reconciles, as the Rust head does: RECONCILE
        first, then the RECONCILE_ACK and every event it says is being sent again. (The Rust
        head then sends each held session's content again, and places the others anew; a test
        does what it needs of that itself.)"""
        self.endpoint.close()
        self.endpoint, self.node = _open(
            self.addr, self.auth, self.noise, self.versions, LinkRole.HeadDaemon, timeout, self.heartbeat
        )
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

    def __enter__(self) -> Head:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- commands -------------------------------------------------------------------------

    def assign(
        self,
        session_id: int,
        params: GenParams = GenParams(),
        lease: Lease = LEASE,
        *,
        qos_class: int = 0,
        codec: str = "mock",
    ) -> int:
        """Places the session at a fresh epoch; returns the epoch."""
        epoch = next(_epochs)
        msg = self.session.assign_session(session_id, epoch, lease, qos_class, codec, encode_params(params))
        self.endpoint.send(msg_type.SESSION_ASSIGN, msg)
        return epoch

    def append(self, session_id: int, tokens: list[int]) -> None:
        """Replaces the session's whole context on the node."""
        msg = self.session.append_content(session_id, encode_tokens(tokens))
        self.endpoint.send(msg_type.APPEND_CONTENT, msg)

    def revoke(self, session_id: int) -> None:
        self.endpoint.send(msg_type.SESSION_REVOKE, self.session.revoke(session_id))

    def next_id(self) -> int:
        """A fresh generation or stage request id."""
        return next(self._ids)

    def request(self, session_id: int, max_new: int, max_wall_ms: int = 60_000) -> GenerateReqMsg:
        """Sends a GENERATE_REQ for a fresh generation id and returns it (to replay or collect)."""
        budgets = GenerationBudgetsMsg(max_new_tokens=max_new, max_wall_ms=max_wall_ms)
        req = self.session.generate(session_id, self.next_id(), budgets)
        self.endpoint.send(msg_type.GENERATE_REQ, req)
        return req

    def collect(self, req: GenerateReqMsg, timeout: float = TIMEOUT) -> Generation:
        """Waits for the generation's Finish; returns everything it sent."""
        key = (req.session_id, req.generation_id)
        self.until(
            lambda: key in self.generations and self.generations[key].finish is not None,
            timeout,
            f"a Finish for session {key[0]} generation {key[1]}",
        )
        self.session.retire_generation(*key)
        return self.generations[key]

    def generate(self, session_id: int, max_new: int, max_wall_ms: int = 60_000, timeout: float = TIMEOUT) -> Generation:
        return self.collect(self.request(session_id, max_new, max_wall_ms), timeout)

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
        return self.stage_answer(self.send_stage(tokens, start, end, hidden_in), timeout)

    def keepalive(self) -> None:
        self.endpoint.send(msg_type.KEEPALIVE)

    # ---- reading --------------------------------------------------------------------------

    def pump(self) -> list[Received]:
        """One read of the link; every frame it brought, handled."""
        return [self._handle(frame) for frame in self.endpoint.pump()]

    def until(self, done, timeout: float, what: str) -> None:
        """Reads the link until `done()` holds; HeadTimeout after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() >= deadline:
                raise HeadTimeout(f"no {what} from the node within {timeout} s")
            self.pump()

    def idle(self, seconds: float) -> None:
        """Reads (and answers) whatever the node sends for `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.pump()

    def wait_for(self, wanted: int, timeout: float = TIMEOUT) -> Received:
        """The next frame of type `wanted` read from now on."""
        start = len(self.received)
        self.until(lambda: any(r.frame.msg_type == wanted for r in self.received[start:]), timeout, f"0x{wanted:04x}")
        return next(r for r in self.received[start:] if r.frame.msg_type == wanted)

    def of_type(self, wanted: int) -> list[Received]:
        return [r for r in self.received if r.frame.msg_type == wanted]

    def closed_by_node(self, timeout: float) -> bool:
        """Whether the node hangs up within `timeout` (the link reads as Closed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.pump()
            except LinkFError.Closed:
                return True
        return False

    def _handle(self, frame: Frame) -> Received:
        msg = decode_payload(frame.msg_type, frame.payload)
        got = Received(time.monotonic(), frame, msg)
        self.received.append(got)
        if frame.msg_type == msg_type.TOKEN_EVENTS:
            self._on_events(msg)
        elif frame.msg_type == msg_type.LEASE_RENEW and self.grant_renewals:
            grant = self.session.on_lease_renew(msg)
            if grant is not None:
                self.endpoint.send(msg_type.LEASE_GRANT, grant)
        elif frame.msg_type == msg_type.STAGE_FORWARD_RESP:
            self.stage_answers[msg.request_id] = msg
        return got

    def _on_events(self, msg) -> None:
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
        if not self.lose_events:
            for ack in self.session.on_token_events(msg):
                self.endpoint.send(msg_type.WATERMARK_ACK, ack)

    def _events_since(self, start: int) -> set[tuple[int, int, int]]:
        return {
            (e.session_id, e.generation_id, e.event_seq)
            for r in self.received[start:]
            if r.frame.msg_type == msg_type.TOKEN_EVENTS
            for e in r.msg.events
        }


def _open(addr, auth: bytes, noise: bool, versions, role, timeout: float, heartbeat: float):
    if noise:
        endpoint = Endpoint.connect_tcp_secure(addr, auth, timeout, timeout)
    else:
        endpoint = Endpoint.connect_tcp(addr, timeout)
    try:
        node = endpoint.hello_as_head(auth, timeout, versions=versions, role=role)
    except BaseException:
        endpoint.close()
        raise
    endpoint.keep_alive(Liveness(heartbeat=heartbeat, silence=0.0))
    return endpoint, node


# ---- raw bytes, for peers that break the protocol -------------------------------------------

_HEADER = struct.Struct("<IHHQQB")


def raw_frame(msg_type_: int, payload: bytes = b"", *, version: int = 3, seq: int = 1, class_byte: int | None = None,
              length: int | None = None) -> bytes:
    """A frame's bytes, any field of which may be wrong on purpose."""
    if class_byte is None:
        class_byte = 1 if msg_type_ & 0x8000 else 0
    if length is None:
        length = 21 + len(payload)
    return _HEADER.pack(length, version, msg_type_, seq, 0, class_byte) + payload


def raw_connect(addr, timeout: float = 5.0) -> socket.socket:
    host, _, port = addr.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout)
    sock.settimeout(timeout)
    return sock


def hung_up(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closes `sock` within `timeout`, reading (and dropping) what it sends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True
    return False


# ---- what the mock engine must produce ---------------------------------------------------------

MOCK_VOCAB = 32000
MOCK_LAYERS = 24


def mock_tokens(prompt: list[int], max_new: int, seed: int = 0) -> list[int]:
    """The mock engine's generation, computed from its spec by hashing the whole context anew
    at every step: step k hashes LE32 of every token so far, then LE64(seed + len(prompt) + k)."""
    context = list(prompt)
    base = seed + len(prompt)
    for k in range(max_new):
        data = struct.pack(f"<{len(context)}I", *context) + struct.pack("<Q", (base + k) % 2**64)
        context.append(xxhash.xxh3_64_intdigest(data) % MOCK_VOCAB)
    return context[len(prompt):]


def mock_stage(tokens: list[int], start: int, end: int, hidden_in: bytes | None = None) -> bytes | int:
    """The mock's stage forward: the hidden bytes before the last layer, the token at it."""
    if hidden_in is None:
        h = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens))
    else:
        h = int.from_bytes(hidden_in, "little")
    for layer in range(start, end):
        h = xxhash.xxh3_64_intdigest(struct.pack("<QI", h, layer))
    return h % MOCK_VOCAB if end >= MOCK_LAYERS else struct.pack("<Q", h)


def raw_hello(addr, versions: tuple[int, int] = (2, 3), auth: bytes = b"") -> tuple[socket.socket, Endpoint]:
    """A connection past HELLO whose socket the caller also writes to directly."""
    sock = raw_connect(addr)
    endpoint = Endpoint.from_tcp(sock)
    endpoint.hello_as_head(auth, 5.0, versions=versions)
    return sock, endpoint
