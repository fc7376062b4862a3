"""A head and a node agent over a lossy pipe that drops, duplicates and reorders frames,
reconnects (losing what was in flight, then RECONCILE), lets leases run out and moves sessions
to new epochs. Whatever happens, the head's WAL holds single contiguous streams, commits no
event twice, no event of a superseded epoch and nothing the agent did not emit; and whenever
the link heals, every generation that finished on the agent, in a session the agent still
holds at the head's epoch, is committed whole.

Hypothesis turns a random subset of rules off in each example (swarm testing), so the rules
are few and broad: with narrow ones, most examples would never get a generation finished."""

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from conformance.wal import WalStub
from linkf import AgentSession, HeadSession
from proto import postcard
from proto.linkf import GenerationBudgetsMsg, Lease, TokenEventPayload, decode_payload, msg_type

SESSIONS = (1, 2)
LEASE = Lease(duration_ms=3000, renew_by_ms=1000)
BUDGETS = GenerationBudgetsMsg(max_new_tokens=64, max_wall_ms=10_000)
pick = st.integers(min_value=0, max_value=1 << 16)


class Pipe:
    """One direction of the link: encoded frames in flight."""

    def __init__(self):
        self.frames: list[tuple[int, bytes]] = []

    def send(self, t, msg):
        self.frames.append((t, postcard.to_bytes(msg)))

    def take(self, i):
        t, payload = self.frames.pop(i % len(self.frames))
        return t, decode_payload(t, payload)


class LinkF(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.wal = WalStub()
        self.head = HeadSession(commit=self.wal.commit)
        self.agent = AgentSession()
        self.to_agent, self.to_head = Pipe(), Pipe()
        self.now = 0
        self.epochs = itertools.count(1)
        self.generation_ids = itertools.count(100)
        #: The newest epoch the head has issued per session: anything older is stale.
        self.latest_epoch: dict[int, int] = {}
        #: Generations the agent accepted and has not finished.
        self.running: set[tuple[int, int]] = set()
        self.emitted: dict[tuple[int, int, int, int], object] = {}
        #: (session, epoch, generation) -> the event_seq of its Finish.
        self.finished: dict[tuple[int, int, int], int] = {}
        self.checked_in_wal: dict[int, int] = {}

    @initialize()
    def start(self):
        for sid in SESSIONS:
            self.assign(sid)

    # The head

    @rule(sid=st.sampled_from(SESSIONS), act=st.sampled_from(["generate"] * 4 + ["place", "move", "revoke"]))
    def head_acts(self, sid, act):
        """Asks for a generation; places a session it does not have; moves one to a fresh
        epoch; or revokes it."""
        if act == "generate":
            self.generate(sid)
        elif act == "revoke":
            msg = self.head.revoke(sid)
            if msg is not None:
                self.to_agent.send(msg_type.SESSION_REVOKE, msg)
        elif act == "move" or self.head.current_epoch(sid) is None:
            self.assign(sid)

    def generate(self, sid):
        req = self.head.generate(sid, next(self.generation_ids), BUDGETS)
        if req is not None:
            self.to_agent.send(msg_type.GENERATE_REQ, req)

    def assign(self, sid):
        epoch = next(self.epochs)
        self.latest_epoch[sid] = epoch
        self.to_agent.send(msg_type.SESSION_ASSIGN, self.head.assign_session(sid, epoch, LEASE))

    # The agent

    @rule(
        i=pick,
        n=st.integers(min_value=1, max_value=4),
        act=st.sampled_from(["emit"] * 3 + ["finish"] * 2 + ["tick"] * 2 + ["expire"]),
    )
    def agent_acts(self, i, n, act):
        """A running generation emits ``n`` events (the last one its Finish), or with none
        running the head asks for one; or time passes, a little or past every lease, and the
        agent renews and fences as it must."""
        if act in ("tick", "expire"):
            self.now += 100 * n if act == "tick" else LEASE.duration_ms
            self.agent.poll(self.now)
            for renew in self.agent.needs_renew(self.now):
                self.to_head.send(msg_type.LEASE_RENEW, renew)
        elif self.running:
            self.emit(*sorted(self.running)[i % len(self.running)], n, finish=act == "finish")
        else:
            self.generate(SESSIONS[i % len(SESSIONS)])

    def emit(self, sid, gid, n, finish):
        for k in range(n):
            last = finish and k == n - 1
            payload = TokenEventPayload.Finish(reason=1) if last else TokenEventPayload.Tokens(tokens=[k, n])
            batch = self.agent.emit(sid, gid, payload)
            if batch is None:
                self.running.discard((sid, gid))
                return
            (ev,) = batch.events
            self.emitted[(sid, ev.epoch, gid, ev.event_seq)] = payload
            self.to_head.send(msg_type.TOKEN_EVENTS, batch)
            if last:
                self.running.discard((sid, gid))
                self.finished[(sid, ev.epoch, gid)] = ev.event_seq

    # The link

    @rule(
        to_agent=st.booleans(),
        fate=st.sampled_from(["flow", "flow", "flow", "reorder", "drop", "duplicate", "reconnect", "heal"]),
        i=pick,
    )
    def network(self, to_agent, fate, i):
        """Frames arrive in order (a few each way); or one arrives out of order, is lost or
        is sent twice; or the connection drops with everything in flight and the head
        reconciles first; or the link heals (see ``heal``)."""
        pipe = self.to_agent if to_agent else self.to_head
        if fate == "flow":
            for _ in range(1 + i % 8):
                if self.to_agent.frames:
                    self.agent_takes(*self.to_agent.take(0))
                if self.to_head.frames:
                    self.head_takes(*self.to_head.take(0))
        elif fate == "reconnect":
            self.to_agent.frames.clear()
            self.to_head.frames.clear()
            self.to_agent.send(msg_type.RECONCILE, self.head.reconcile())
        elif fate == "heal":
            self.heal()
        elif pipe.frames:
            i %= len(pipe.frames)
            if fate == "drop":
                pipe.frames.pop(i)
            elif fate == "duplicate":
                pipe.frames.append(pipe.frames[i])
            elif to_agent:
                self.agent_takes(*pipe.take(i))
            else:
                self.head_takes(*pipe.take(i))

    def agent_takes(self, t, msg):
        if t == msg_type.SESSION_ASSIGN:
            self.agent.on_assign(msg, self.now)
        elif t == msg_type.SESSION_REVOKE:
            self.agent.on_revoke(msg)
        elif t == msg_type.GENERATE_REQ:
            if self.agent.on_generate(msg):
                self.running.add((msg.session_id, msg.generation_id))
        elif t == msg_type.WATERMARK_ACK:
            self.agent.on_watermark_ack(msg)
        elif t == msg_type.LEASE_GRANT:
            self.agent.on_lease_grant(msg, self.now)
        elif t == msg_type.RECONCILE:
            ack, again = self.agent.on_reconcile(msg, self.now)
            self.to_head.send(msg_type.RECONCILE_ACK, ack)
            for batch in again:
                self.to_head.send(msg_type.TOKEN_EVENTS, batch)
        else:
            raise AssertionError(f"unexpected 0x{t:04x}")

    def head_takes(self, t, msg):
        if t == msg_type.TOKEN_EVENTS:
            self.commit(msg, self.to_agent.send)
        elif t == msg_type.LEASE_RENEW:
            grant = self.head.on_lease_renew(msg)
            if grant is not None:
                self.to_agent.send(msg_type.LEASE_GRANT, grant)
        elif t == msg_type.RECONCILE_ACK:
            self.replace_lost(msg)
        else:
            raise AssertionError(f"unexpected 0x{t:04x}")

    def commit(self, batch, send_ack):
        """Hands ``batch`` to the head, acks back through ``send_ack``, and checks each event
        the head committed: of the session's newest epoch, and exactly what the agent sent."""
        for ack in self.head.on_token_events(batch):
            send_ack(msg_type.WATERMARK_ACK, ack)
        for sid in SESSIONS:
            log = self.wal.session_events(sid)
            for c in log[self.checked_in_wal.get(sid, 0) :]:
                e = c.event
                assert e.epoch == self.latest_epoch[sid], f"stale epoch {e.epoch} committed"
                key = (sid, e.epoch, e.generation_id, e.event_seq)
                assert self.emitted.get(key) == e.payload, f"committed {key} is not what the agent emitted"
            self.checked_in_wal[sid] = len(log)

    def heal(self):
        """One clean reconnect and reconcile; then every finished generation of a session the
        agent still holds at the head's epoch must be in the WAL, whole."""
        self.to_agent.frames.clear()
        self.to_head.frames.clear()
        ack, again = self.agent.on_reconcile(self.head.reconcile(), self.now)
        for batch in again:
            self.commit(batch, lambda _t, m: self.agent.on_watermark_ack(m))
        held = {s.session_id for s in ack.sessions if s.held}
        for (sid, epoch, gid), last in self.finished.items():
            if sid in held and self.head.current_epoch(sid) == epoch:
                got = self.wal.generation_events(sid, epoch, gid)
                assert [e.event_seq for e in got] == list(range(last + 1)), (sid, epoch, gid)
                assert isinstance(got[-1].payload, TokenEventPayload.Finish)
        self.replace_lost(ack)

    def replace_lost(self, ack):
        """As a head does: places again, at a fresh epoch, the sessions the node lost."""
        for sid in self.head.on_reconcile_ack(ack):
            if self.head.current_epoch(sid) is not None:
                self.assign(sid)

    @invariant()
    def streams_are_single_and_contiguous(self):
        self.wal.assert_single_contiguous_streams()
        keys = [
            (c.event.session_id, c.event.epoch, c.event.generation_id, c.event.event_seq)
            for sid in SESSIONS
            for c in self.wal.session_events(sid)
        ]
        assert len(keys) == len(set(keys)), "an event was committed twice"

    def teardown(self):
        self.heal()


LinkF.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_linkf_stateful = LinkF.TestCase
