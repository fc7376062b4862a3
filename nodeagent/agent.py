"""The node agent: serves a head over Link F from one daemon (node-behaviour.md §1).

One `NodeAgent.serve` runs per accepted connection, on a thread of its own. Every connection of
a node shares one `AgentShared`, so a session placed over one connection survives it and can
be reconciled over the next. Generations and stage forwards run on worker threads of their own
and hand what they produce to the connection's loop through a bounded queue, so the loop keeps
reading the head (cancels, lease grants, heartbeats) and sending status while they run.

The loop sleeps in one poll(2) until the head sends a frame, a worker hands something over
(its `Waker`), or the next deadline (status, lease renewal or expiry, idle drop) is due; the
Rust node woke every 2 ms while work ran and every 20 ms otherwise. While a generation streams, the
loop looks once a stream interval (`nodeagent.outbox`): the tokens of the steps since its last
look go out together, and the head's frames (mostly its acknowledgements) are read in the same
pass, neither waking it in between. Each pass does a bounded amount of work, so a frame from the
head is read within one pass whatever the engine produces.

Only a connection's own thread touches its socket. The torch scheduler hands each step's
tokens to the generation's outbox; the loop sends them in its next pass, with what else piled
up meanwhile.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from linkf.agent import AgentSession, SelfFence
from linkf.driver import DEFAULT_LIVENESS, PROTO_VERSION, Endpoint, Liveness
from linkf.errors import Closed, LinkFError, TimedOut
from linkf.message import Message
from linkf.waker import Waker
from nodeagent.daemon import (
    ConstraintError,
    Daemon,
    DaemonError,
    EngineFault,
    GenerationError,
    GenerationResult,
    GenExtras,
    StageHidden,
    StageToken,
    StreamTooLong,
    host_memory_bytes,
)
from nodeagent.load import U32_MAX, LoadMeter, LoadSample
from nodeagent.logs import fields
from nodeagent.observe import GenerationWatch, NodeObserver
from nodeagent.outbox import STREAM_INTERVAL_S, Outbox
from proto import finish, postcard
from proto.envelope import MAX_FRAME
from proto.fleet import decode_params, decode_tokens
from proto.handshake import CapacitySummary, HelloAckF
from proto.linkf import (
    GenerateReqMsg,
    LinkFLimits,
    NodeStatusMsg,
    StageForwardReqMsg,
    StageForwardRespMsg,
    TokenEvent,
    TokenEventPayload,
    TokenEventsMsg,
    WatermarkAckMsg,
    msg_type,
)
from proto.linkw import MemCountersMsg
from proto.params import GenParams
from proto.postcard import PostcardError

log = logging.getLogger(__name__)


DEFAULT_HANDSHAKE_TIMEOUT = 10.0
#: Seconds the head may stay silent before the node drops the connection: six heartbeats.
DEFAULT_IDLE_TIMEOUT = 30.0

#: Seconds a head may take no bytes, or acknowledge no event, while the node has a
#: generation's output waiting for it; then the connection is dropped and its generation
#: stopped, which frees its lane and KV. The Rust node wrote on a blocking socket with no limit.
DEFAULT_WRITE_TIMEOUT = 10.0

STATUS_INTERVAL_MS = 2_000
#: How long one encoded NODE_STATUS serves every connection (`NodeAgent.status_payload`).
STATUS_SHARE_MS = 100
#: Seconds after which a renewal the head left unanswered is asked for again.
RENEW_RETRY = 1.0
#: The most tokens one TOKEN_EVENTS carries, which bounds one pass's work. What goes out together
#: is what piled up since the loop's last look (`nodeagent.outbox`'s stream interval).
EVENT_TOKENS_MAX = 1024
#: Transfers in flight that HELLO_ACK_F advertises (`LinkFLimits.transfer_window`).
TRANSFER_WINDOW = 8
#: Tokens of one generation the head may leave unacknowledged before the loop stops taking its
#: output: a window of `TRANSFER_WINDOW` full events, 8,192 tokens.
UNACKED_TOKENS_MAX = TRANSFER_WINDOW * EVENT_TOKENS_MAX
#: Events likewise: a slow engine sends one token an event, and a head that acknowledges in
#: batches (or, on version 2, not while it waits) must not stall it.
UNACKED_EVENTS_MAX = 1024

_connections = itertools.count(1)
#: The machine's memory, in every capacity the node reports: it does not change while it runs.
HOST_MEMORY = host_memory_bytes()
#: Frames that may move a lease deadline, after which the loop works out the next one anew.
_LEASE_TYPES = frozenset(
    (msg_type.SESSION_ASSIGN, msg_type.SESSION_REVOKE, msg_type.LEASE_GRANT, msg_type.RECONCILE)
)


@dataclass(frozen=True)
class SharedStatus:
    at_ms: int
    payload: bytes


@dataclass
class AgentShared:
    """What every connection of one node shares; touch it only while holding `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    agent: AgentSession = field(default_factory=AgentSession)
    #: The connection each session was placed over: the one whose head answers its renewals.
    owners: dict[int, int] = field(default_factory=dict)
    contexts: dict[int, list[int]] = field(default_factory=dict)
    params: dict[int, GenParams] = field(default_factory=dict)
    load: LoadMeter = field(default_factory=LoadMeter)
    #: The last NODE_STATUS encoded, which every connection sends for a while.
    status: SharedStatus | None = None
    #: Generations some connection is running, until their Finish is sent or they are dropped;
    #: by `id`, so a drain can reach each one.
    running: dict[int, Running] = field(default_factory=dict)
    #: Set when a drain runs out of time: every running generation ends with a Finish(ERROR).
    stopping: threading.Event = field(default_factory=threading.Event)

    def running_generations(self) -> int:
        """How many generations are running on any connection (a drain waits for zero)."""
        with self.lock:
            return len(self.running)

    def forget(self, session_id: int) -> None:
        self.contexts.pop(session_id, None)
        self.params.pop(session_id, None)
        self.owners.pop(session_id, None)


@dataclass(frozen=True)
class GenerationJob:
    """What a generation's worker needs to run it."""

    context: Sequence[int]
    params: GenParams
    max_new: int
    max_wall_ms: int
    cancel: threading.Event
    out: Outbox


@dataclass
class Running:
    """A generation running on a connection. Whoever drops one must `stop()` it, which ends the
    generation at its next step (the Rust node did that in `Drop`)."""

    session_id: int
    generation_id: int
    max_new: int
    cancel: threading.Event
    out: Outbox
    #: The head asked for the stop.
    cancelled: bool = False
    #: The node stopped it: its drain ran out of time.
    drained: bool = False
    #: Since when (ms) its output has waited on the head's acknowledgements.
    stalled_since: int | None = None
    #: How the node's observers follow it (metrics, the log).
    watch: GenerationWatch = field(default_factory=GenerationWatch)

    def stop(self) -> None:
        self.cancel.set()


@dataclass
class Work:
    """What a connection has running off its own thread, and the waker its workers set."""

    generation: Running | None = None
    #: Where a stage forward's answer arrives.
    stage: queue.Queue | None = None
    waker: Waker | None = None

    def busy(self) -> bool:
        return self.generation is not None or self.stage is not None

    def waker_for(self, endpoint: Endpoint) -> Waker:
        """The connection's waker, made and watched by `endpoint` when first needed: an idle
        connection holds no descriptor beyond its socket."""
        if self.waker is None:
            self.waker = Waker()
            endpoint.wake_on(self.waker)
        return self.waker

    def close(self, endpoint: Endpoint) -> None:
        if self.waker is not None:
            endpoint.wake_on(None)
            self.waker.close()


class NodeAgent:
    """One node's agent: its daemon, its settings and the state every connection shares;
    `connection()` makes what serves one connection."""

    def __init__(self, daemon: Daemon, identity: str, model_name: str, *, shared: AgentShared | None = None):
        self.daemon = daemon
        self.shared = shared if shared is not None else AgentShared()
        self.identity = identity
        self.model_name = model_name
        self.start = time.monotonic()
        self.handshake_timeout = DEFAULT_HANDSHAKE_TIMEOUT
        self.idle_timeout = DEFAULT_IDLE_TIMEOUT
        self.write_timeout = DEFAULT_WRITE_TIMEOUT
        self.stream_interval = STREAM_INTERVAL_S
        self.auth = b""
        self.max_lanes = 0
        self.observer = NodeObserver()

    def with_max_lanes(self, lanes: int) -> NodeAgent:
        self.max_lanes = lanes
        return self

    def with_timeouts(self, handshake_s: float, idle_s: float) -> NodeAgent:
        """`idle_s`: how long the head may be silent before a connection is dropped, 0 keeps
        every connection; keep it well above the head's 5 s heartbeat."""
        self.handshake_timeout = handshake_s
        self.idle_timeout = idle_s
        return self

    def with_write_timeout(self, seconds: float) -> NodeAgent:
        """How long a head may take no bytes, or acknowledge nothing, while output waits for
        it; 0 waits forever."""
        self.write_timeout = seconds
        return self

    def with_stream_interval(self, seconds: float) -> NodeAgent:
        """How long a streaming generation's one-token steps, and the head's frames, may wait
        for the loop's next look (`nodeagent.outbox`); 0 wakes the loop for every step and
        every frame."""
        self.stream_interval = seconds
        return self

    def with_auth(self, auth: bytes) -> NodeAgent:
        self.auth = bytes(auth)
        return self

    def with_observer(self, observer: NodeObserver) -> NodeAgent:
        """Who hears of sessions, generations and stage forwards (`nodeagent.observe`)."""
        self.observer = observer
        return self

    def connection(self) -> Connection:
        """What serves one more connection: the Rust node made a twin of the whole agent with fresh
        status and renewal clocks; here the node-wide part stays in this agent, shared."""
        return Connection(self)

    def running_generations(self) -> int:
        return self.shared.running_generations()

    def stop_generations(self) -> None:
        """Ends every running generation at its next step with a Finish(ERROR) after the tokens
        it made: what a drain that ran out of time tells the heads. Each is cancelled here, so
        its worker ends and wakes its connection at once, however idle that connection is."""
        self.shared.stopping.set()
        with self.shared.lock:
            for run in self.shared.running.values():
                run.drained = True
                run.stop()

    def now_ms(self) -> int:
        return int((time.monotonic() - self.start) * 1000)

    def fence(self, now: int) -> None:
        """Fences every session whose lease ran out, dropping its context, params and owner."""
        sh = self.shared
        with sh.lock:
            for action in sh.agent.poll(now):
                if isinstance(action, SelfFence):
                    log.warning("node-agent self-fenced on lease expiry", extra=fields(session_id=action.session_id))
                    sh.forget(action.session_id)
                    self.observer.session_fenced(action.session_id)

    # ---- capacity -------------------------------------------------------------------------

    def sample_load(self) -> LoadSample:
        with self.shared.lock:
            return self.shared.load.sample(self.daemon.sched_stats(), self.now_ms())

    def capacity(self) -> CapacitySummary:
        load = self.sample_load()
        with self.shared.lock:
            active = len(self.shared.contexts)
        memory = self.daemon.device_memory()
        return CapacitySummary(
            gpu_memory_bytes=memory.total,
            gpu_memory_free_bytes=memory.free,
            host_memory_bytes=HOST_MEMORY,
            active_sessions=active,
            max_sessions=U32_MAX,
            max_context_tokens=self.daemon.max_stream_tokens(),
            kv_blocks_used=load.kv_blocks_used,
            kv_blocks_total=load.kv_blocks_total,
            lanes_active=load.lanes_active,
            max_lanes=self.max_lanes,
            queue_depth=load.queue_depth,
            decode_tokens_per_s=load.decode_tokens_per_s,
            prefill_tokens_per_s=load.prefill_tokens_per_s,
            sampled_at_ms=load.sampled_at_ms,
        )

    def status_payload(self) -> bytes:
        """NODE_STATUS as postcard bytes. Every connection sends the same node's status, so one
        sample serves them all for `STATUS_SHARE_MS`: 300 connections cost one capacity sample
        and one encoding each time, not 300."""
        now = self.now_ms()
        with self.shared.lock:
            cached = self.shared.status
            if cached is not None and now - cached.at_ms < STATUS_SHARE_MS:
                return cached.payload
        capacity = self.capacity()
        msg = NodeStatusMsg(
            capacity=capacity,
            loadable_models=[self.model_name],
            mem=MemCountersMsg(
                allocated_bytes=0,
                host_retained_bytes=0,
                pool_blocks_total=capacity.kv_blocks_total,
                pool_blocks_used=capacity.kv_blocks_used,
                pool_bytes_evictable=0,
                tentative_bytes=0,
            ),
        )
        payload = postcard.to_bytes(msg)
        with self.shared.lock:
            self.shared.status = SharedStatus(now, payload)
        return payload

    def ackf(self) -> HelloAckF:
        return HelloAckF(
            chosen_version=PROTO_VERSION,
            node_identity=self.identity,
            capacity=self.capacity(),
            loadable_models=[self.model_name],
            feature_flags=0,
            limits=LinkFLimits(
                max_frame=MAX_FRAME,
                transfer_window=TRANSFER_WINDOW,
                max_transfer=1 << 26,
                transfer_budget=1 << 28,
            ),
        )


class Connection:
    """One connection's serve loop: the Rust node's per-connection twin of `NodeAgent`, holding what
    is the connection's own (its status and renewal clocks) beside the node it serves."""

    def __init__(self, node: NodeAgent) -> None:
        self.node = node
        self.conn = next(_connections)
        self.last_status_ms = 0
        #: When (ms) this connection last asked for each lease not granted yet.
        self.asked: dict[int, int] = {}
        #: When (ms) the leases need looking at next; 0 after a frame that changed one; None
        #: when no lease has a deadline: then they are looked at on every pass, which a status
        #: brings at least every 2 s, and cost no wake of their own.
        self.lease_due_ms: int | None = 0

    def serve(self, endpoint: Endpoint, on_hello: Callable[[], None] | None = None) -> None:
        """Serves one head until it leaves; raises the error (LinkFError or DaemonError) that
        ended the connection otherwise. On the way out it stops the connection's generation and
        closes the endpoint, as dropping them did in the Rust node. `on_hello` runs once the head's
        HELLO is answered: the node's admission counts the connection as a handshake until then."""
        work = Work()
        endpoint.write_timeout(self.node.write_timeout or None)
        try:
            try:
                endpoint.answer_hello_as_agent(self.node.ackf(), self.node.auth, self.node.handshake_timeout or None)
            except TimedOut:
                log.warning("node-agent dropped a silent connection (no Hello)")
                return
            if on_hello is not None:
                on_hello()
            if self.node.idle_timeout:
                heartbeat = min(DEFAULT_LIVENESS.heartbeat, self.node.idle_timeout / 3)
            else:
                heartbeat = DEFAULT_LIVENESS.heartbeat
            endpoint.keep_alive(Liveness(heartbeat=heartbeat, silence=self.node.idle_timeout))
            self.serve_link(endpoint, work)
        finally:
            self.drop_generation(work)
            work.close(endpoint)
            endpoint.close()

    def send_status(self, endpoint: Endpoint) -> None:
        # A status that does not leave is no loss; a dead link shows at the next pump.
        try:
            endpoint.send_payload(msg_type.NODE_STATUS, self.node.status_payload())
        except LinkFError:
            pass
        self.last_status_ms = self.node.now_ms()

    def serve_link(self, endpoint: Endpoint, work: Work) -> None:
        try:
            while self.serve_pass(endpoint, work):
                pass
        except Closed:
            return
        except TimedOut:
            if endpoint.broken is not None or _stalled(work):
                log.warning(
                    "node-agent dropped a connection the head stopped reading",
                    extra=fields(write_timeout_s=self.node.write_timeout),
                )
            else:
                log.warning(
                    "node-agent dropped a connection the head went silent on",
                    extra=fields(quiet_ms=int(endpoint.quiet_for() * 1000)),
                )

    def serve_pass(self, endpoint: Endpoint, work: Work) -> bool:
        """One pass of the Rust node's cycle; False once the connection should end."""
        now = self.node.now_ms()
        self.tend_leases(endpoint, now)
        if now >= self.last_status_ms + STATUS_INTERVAL_MS:
            self.send_status(endpoint)
        if work.waker is not None:
            work.waker.clear()
        if work.generation is not None and self.forward(endpoint, work.generation):
            self.drop_generation(work)
        if work.stage is not None:
            self.hand_back_stage(endpoint, work)
        for message in endpoint.pump(self.sleep_s(endpoint, work, now), self.hear_within(work)):
            self.handle(endpoint, message, work)
        run = work.generation
        if run is not None and run.stalled_since is not None and self.node.write_timeout:
            if self.node.now_ms() - run.stalled_since >= self.node.write_timeout * 1000:
                raise TimedOut("the head acknowledged nothing", peer=endpoint.peer)
        # A version-2 head sends nothing while it waits on a generation, so only a
        # connection with nothing running can be idle.
        if endpoint.version() < 3 and not work.busy() and self.node.idle_timeout:
            if endpoint.quiet_for() >= self.node.idle_timeout:
                log.info("node-agent dropped an idle connection")
                return False
        return True

    def sleep_s(self, endpoint: Endpoint, work: Work, now: int) -> float:
        """How long the pass may sleep in `pump`: not at all while output waits to go, else
        until the next deadline or the generation's next look (a worker's hand-over and the
        head's frames wake it sooner)."""
        run = work.generation
        look = None if run is None or run.stalled_since is not None else run.out.look_within()
        if look == 0:
            return 0.0
        due = [self.last_status_ms + STATUS_INTERVAL_MS]
        if self.lease_due_ms is not None:
            due.append(self.lease_due_ms)
        if run is not None and run.stalled_since is not None and self.node.write_timeout:
            due.append(run.stalled_since + int(self.node.write_timeout * 1000))
        if endpoint.version() < 3 and not work.busy() and self.node.idle_timeout:
            due.append(now + int((self.node.idle_timeout - endpoint.quiet_for()) * 1000))
        wait = max(min(due) - self.node.now_ms(), 0) / 1000
        return wait if look is None else min(wait, look)

    @staticmethod
    def hear_within(work: Work) -> float | None:
        """How long the head's frames may wait for the pass that sends the next tokens: while a
        generation streams, up to a stream interval after its last tokens went out; None (they
        wake the loop) once it pauses, or waits on the head. The Rust node woke for every
        frame."""
        run = work.generation
        if run is None or run.stalled_since is not None:
            return None
        return run.out.interval_left()

    def tend_leases(self, endpoint: Endpoint, now: int) -> None:
        """Renews and fences once a lease deadline has come, and works out the next one."""
        if self.lease_due_ms is not None and now < self.lease_due_ms:
            return
        awaiting_grant = self.renew(endpoint, now)
        self.node.fence(now)
        with self.node.shared.lock:
            due = self.node.shared.agent.next_deadline(now)
        retry = now + int(RENEW_RETRY * 1000) if awaiting_grant else None
        self.lease_due_ms = min((t for t in (due, retry) if t is not None), default=None)

    def renew(self, endpoint: Endpoint, now: int) -> bool:
        """Asks the head to renew the leases of the sessions placed over this connection, the
        only one where it answers them; asks again each `RENEW_RETRY` until a grant comes.
        True while a renewal awaits its grant."""
        sh = self.node.shared
        with sh.lock:
            due = [r for r in sh.agent.needs_renew(now) if sh.owners.get(r.session_id) == self.conn]
        for renewal in due:
            at = self.asked.get(renewal.session_id)
            if at is not None and now - at < RENEW_RETRY * 1000:
                continue
            endpoint.send(msg_type.LEASE_RENEW, renewal)
            self.asked[renewal.session_id] = now
        return bool(due)

    def handle(self, endpoint: Endpoint, message: Message, work: Work) -> None:
        """Acts on one message from the head; every type without a handler below is ignored,
        its payload never decoded, as in the Rust node."""
        handler = self._handlers.get(message.msg_type)
        if handler is not None:
            handler(self, endpoint, message.msg, work)
        if message.msg_type in _LEASE_TYPES:
            self.lease_due_ms = 0

    def on_reconcile(self, endpoint: Endpoint, m, work: Work) -> None:
        sh = self.node.shared
        with sh.lock:
            ack, retransmissions = sh.agent.on_reconcile(m, self.node.now_ms())
            for s in ack.sessions:
                if s.held:
                    sh.owners[s.session_id] = self.conn
        endpoint.send(msg_type.RECONCILE_ACK, ack)
        for batch in retransmissions:
            endpoint.send(msg_type.TOKEN_EVENTS, batch)

    def on_assign(self, endpoint: Endpoint, m, work: Work) -> None:
        sh = self.node.shared
        with sh.lock:
            if sh.agent.on_assign(m, self.node.now_ms()):
                sh.params[m.session_id] = decode_params(m.params)
                sh.owners[m.session_id] = self.conn
                self.asked.pop(m.session_id, None)
                self.node.observer.session_assigned(m.session_id, m.epoch)

    def on_revoke(self, endpoint: Endpoint, m, work: Work) -> None:
        sh = self.node.shared
        with sh.lock:
            if sh.agent.on_revoke(m):
                sh.forget(m.session_id)
                self.asked.pop(m.session_id, None)
                self.node.observer.session_revoked(m.session_id)

    def on_append(self, endpoint: Endpoint, m, work: Work) -> None:
        sh = self.node.shared
        with sh.lock:
            if sh.agent.on_append(m.session_id, m.epoch, m.command_id):
                try:
                    sh.contexts[m.session_id] = decode_tokens(m.blocks)
                except PostcardError as e:
                    raise DaemonError(f"malformed APPEND_CONTENT blocks session_id={m.session_id}: {e}") from e

    def on_generate(self, endpoint: Endpoint, m: GenerateReqMsg, work: Work) -> None:
        # With a generation already running the request is declined before the session sees
        # it, so its command stays unconsumed.
        if work.generation is None:
            with self.node.shared.lock:
                accepted = self.node.shared.agent.on_generate(m)
        else:
            accepted = False
        if accepted:
            work.generation = self.start_generation(m, work.waker_for(endpoint), endpoint)
            return
        log.warning(
            "declining a generate (unknown session, superseded epoch, replayed command, or one "
            "already running on this connection); reporting it rather than going silent",
            extra=fields(session=m.session_id, generation=m.generation_id, epoch=m.epoch),
        )
        declined = TokenEvent(
            session_id=m.session_id,
            epoch=m.epoch,
            generation_id=m.generation_id,
            event_seq=0,
            payload=TokenEventPayload.Finish(reason=finish.DECLINED),
        )
        self.node.observer.generation_declined(m.session_id, m.generation_id)
        endpoint.send(msg_type.TOKEN_EVENTS, TokenEventsMsg(events=[declined]))

    def on_cancel(self, endpoint: Endpoint, m, work: Work) -> None:
        run = work.generation
        if run is not None and (run.session_id, run.generation_id) == (m.session_id, m.generation_id):
            run.cancelled = True
            run.stop()

    def on_stage(self, endpoint: Endpoint, m: StageForwardReqMsg, work: Work) -> None:
        if work.stage is None:
            work.stage = self.start_stage(m, work.waker_for(endpoint))
        else:
            # The head waits on one stage per connection; another is answered as one the
            # node could not run.
            busy = StageForwardRespMsg(request_id=m.request_id, hidden=None, token=None)
            endpoint.send(msg_type.STAGE_FORWARD_RESP, busy)

    def on_watermark_ack(self, endpoint: Endpoint, m: WatermarkAckMsg, work: Work) -> None:
        """Drops what the head has committed from the retry buffers."""
        with self.node.shared.lock:
            self.node.shared.agent.on_watermark_ack(m)

    def on_lease_grant(self, endpoint: Endpoint, m, work: Work) -> None:
        with self.node.shared.lock:
            self.node.shared.agent.on_lease_grant(m, self.node.now_ms())
        self.asked.pop(m.session_id, None)

    _handlers: dict[int, Callable[..., None]] = {
        msg_type.RECONCILE: on_reconcile,
        msg_type.SESSION_ASSIGN: on_assign,
        msg_type.SESSION_REVOKE: on_revoke,
        msg_type.APPEND_CONTENT: on_append,
        msg_type.GENERATE_REQ: on_generate,
        msg_type.GENERATE_CANCEL: on_cancel,
        msg_type.STAGE_FORWARD_REQ: on_stage,
        msg_type.WATERMARK_ACK: on_watermark_ack,
        msg_type.LEASE_GRANT: on_lease_grant,
    }

    # ---- work off the connection's thread ---------------------------------------------------

    def start_stage(self, m: StageForwardReqMsg, waker: Waker) -> queue.Queue:
        """Runs a stage forward on a thread of its own, as a generation runs, so a long one does
        not leave the connection unread."""
        answer: queue.Queue = queue.Queue(maxsize=1)
        threading.Thread(
            target=_run_stage, args=(self.node.daemon, m, answer, waker), name="node-stage", daemon=True
        ).start()
        return answer

    def hand_back_stage(self, endpoint: Endpoint, work: Work) -> None:
        if work.stage is None:
            return
        try:
            resp = work.stage.get_nowait()
        except queue.Empty:
            return
        work.stage = None
        endpoint.send(msg_type.STAGE_FORWARD_RESP, resp)
        self.node.observer.stage_forwarded(resp.hidden is not None or resp.token is not None)

    def start_generation(self, req: GenerateReqMsg, waker: Waker, endpoint: Endpoint) -> Running:
        """Starts `req` on a thread of its own, so this connection goes on reading the head and
        sending status while it runs."""
        sh = self.node.shared
        with sh.lock:
            context = list(sh.contexts.get(req.session_id, ()))
            params = sh.params.get(req.session_id, GenParams())
        cancel = threading.Event()
        run = Running(
            session_id=req.session_id,
            generation_id=req.generation_id,
            max_new=min(req.budgets.max_new_tokens, U32_MAX),
            cancel=cancel,
            out=Outbox(waker, cancel, interval=self.node.stream_interval),
            watch=self.node.observer.generation_started(req.session_id, req.generation_id, len(context)),
        )
        job = GenerationJob(context, params, run.max_new, req.budgets.max_wall_ms, cancel, run.out)
        with sh.lock:
            sh.load.busy.start()
            sh.running[id(run)] = run
            if sh.stopping.is_set():  # a drain already stopping the others stops this one too
                run.drained = True
                run.stop()
        try:
            threading.Thread(
                target=_run_generation, args=(self.node.daemon, sh, job), name="node-generation", daemon=True
            ).start()
        except RuntimeError as e:  # no thread to be had: the counters must not keep it
            with sh.lock:
                sh.load.busy.stop()
                del sh.running[id(run)]
            raise GenerationError(f"cannot start a generation's worker: {e}") from e
        return run

    def drop_generation(self, work: Work) -> None:
        """Lets go of the connection's generation, stopping it if it still runs."""
        if work.generation is None:
            return
        work.generation.stop()
        work.generation.out.release()
        work.generation.watch.dropped()
        with self.node.shared.lock:
            del self.node.shared.running[id(work.generation)]
        work.generation = None

    def room(self, run: Running) -> int:
        """How many tokens `run`'s next event may carry: 0 while the head's unacknowledged
        events fill the window."""
        with self.node.shared.lock:
            unacked = self.node.shared.agent.unacked(run.session_id, run.generation_id)
        if unacked.events >= UNACKED_EVENTS_MAX:
            return 0
        return max(min(EVENT_TOKENS_MAX, UNACKED_TOKENS_MAX - unacked.tokens), 0)

    def forward(self, endpoint: Endpoint, run: Running) -> bool:
        """Sends what `run` produced since the last pass, at most `EVENT_TOKENS_MAX` tokens, and
        its finish once it ends; takes nothing while the head's unacknowledged events fill the
        window. True once it has ended, or its session was fenced and it goes silent."""
        sh = self.node.shared
        room = self.room(run)
        if room <= 0:
            if run.stalled_since is None:
                run.stalled_since = self.node.now_ms()
            return False
        run.stalled_since = None
        tokens, done = run.out.take(room)
        if tokens and not self.flush(endpoint, run, tokens):
            return True
        with sh.lock:
            if sh.agent.is_fenced(run.session_id) is not False:
                return True
            if done is None:
                return False
            reason = self.finish_reason(run, done.generated)
            batch = sh.agent.emit(run.session_id, run.generation_id, TokenEventPayload.Finish(reason=reason))
        if batch is not None:
            run.watch.finished(reason)  # before the send: see `flush`
            endpoint.send(msg_type.TOKEN_EVENTS, batch)
        return True

    @staticmethod
    def finish_reason(run: Running, generated: GenerationResult | DaemonError | None) -> int:
        """The reason `run` ended with; raises the daemon's error when it is not the head's."""
        if generated is None:
            raise GenerationError("the generation ended without a result")
        if isinstance(generated, EngineFault):
            log.warning(
                "the engine failed a generation; ending it with Finish(ERROR) so the head retries elsewhere",
                extra=fields(session=run.session_id, generation=run.generation_id, error=generated),
            )
            return finish.ERROR
        if isinstance(generated, DaemonError):
            if not is_client_refusal(generated):
                raise generated
            log.warning(
                "refusing a generation the node cannot stage; the head should have caught this "
                "before dispatch",
                extra=fields(session=run.session_id, generation=run.generation_id, error=generated),
            )
            return finish.REFUSED
        if run.drained and generated.finish == finish.CANCELLED:
            return finish.ERROR
        if run.cancelled:
            return finish.CANCELLED
        if generated.expired:
            return finish.EXPIRED
        if len(generated.tokens) >= run.max_new:
            return finish.LENGTH
        return finish.EOS

    def flush(self, endpoint: Endpoint, run: Running, tokens: list[int]) -> bool:
        """Sends `tokens` as `run`'s next event; False when its session is fenced, which sends
        nothing."""
        batch = self.emit_tokens(run, tokens)
        if batch is None:
            return False
        endpoint.send(msg_type.TOKEN_EVENTS, batch)
        return True

    def emit_tokens(self, run: Running, tokens: list[int]) -> TokenEventsMsg | None:
        """`tokens` as `run`'s next event, to send at once; None when its session is fenced."""
        payload = TokenEventPayload.Tokens(tokens=list(tokens))
        with self.node.shared.lock:
            batch = self.node.shared.agent.emit(run.session_id, run.generation_id, payload)
        if batch is None:
            return None
        # Observed before the send, so a head that has read the event finds it in the metrics
        # and the log already (a send that fails ends the connection anyway).
        run.watch.tokens_sent(len(tokens))
        return batch


def _run_generation(daemon: Daemon, shared: AgentShared, job: GenerationJob) -> None:
    """A generation's worker: each batch goes to the outbox, then the result; stops at the next
    batch once cancelled, or at once while it still waits for a lane."""
    generated: GenerationResult | DaemonError | None = None
    try:
        extras = GenExtras(cancel=job.cancel, consumer=job.out)
        generated = daemon.generate_tokens_streaming(
            job.context, job.params, job.max_new, job.max_wall_ms, extras, job.out.put
        )
    except DaemonError as e:
        generated = e
    except Exception:
        log.exception("a generation's worker failed; its connection ends")
    finally:
        with shared.lock:
            shared.load.busy.stop()
        job.out.finish(generated)


def _run_stage(daemon: Daemon, m: StageForwardReqMsg, answer: queue.Queue, waker: Waker) -> None:
    """A stage forward's worker. Any failure is answered as a stage the node could not run:
    the head has no timeout on a stage, so a worker that answered nothing would wedge it (the
    Rust node went silent when its worker panicked; linkf-wire §7 asks for an answer)."""
    resp = StageForwardRespMsg(request_id=m.request_id, hidden=None, token=None)
    try:
        output = daemon.forward_stage(m.tokens, m.start_layer, m.end_layer, m.hidden_in)
        if isinstance(output, StageHidden):
            resp.hidden = output.data
        elif isinstance(output, StageToken):
            resp.token = output.token
    except DaemonError as e:
        log.warning(
            "a stage forward the node could not run; answering it empty",
            extra=fields(request=m.request_id, start=m.start_layer, end=m.end_layer, error=e),
        )
    except Exception:
        log.exception("a stage forward's worker failed; answering it as not run")
    finally:
        answer.put(resp)
        waker.set()


def _stalled(work: Work) -> bool:
    return work.generation is not None and work.generation.stalled_since is not None


def is_client_refusal(e: DaemonError) -> bool:
    """An error the head caused by sending what the node cannot stage."""
    return isinstance(e, (StreamTooLong, ConstraintError))
