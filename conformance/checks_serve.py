"""Scenarios about serving: generations, their events and finish reasons, declines, cancels,
budgets, stage forwards, status, leases and reconcile (node-behaviour.md §1, linkf-wire.md §6,
§7), and with `--mock` token-exactness against the kit's own reference."""

from __future__ import annotations

import time

from conformance.head import FleetHead, Generation, HeadTimeout, reason
from conformance.reference import MOCK_LAYERS, mock_stage, mock_tokens
from conformance.scenario import Context, Violation, check, scenario, skip
from linkf.errors import Closed
from proto import finish
from proto.linkf import (
    GenerateReqMsg,
    GenerationBudgetsMsg,
    Lease,
    TokenEvent,
    TokenEventPayload,
    msg_type,
)
from proto.params import GenParams

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88]
#: A generation that runs until the scenario stops it (the wall budget ends it otherwise).
LONG = 10**7
LONG_WALL_MS = 30_000
#: How soon a node must act on a GENERATE_CANCEL, or answer a second GENERATE_REQ.
PROMPT_ANSWER_S = 5.0
#: How often a node sends NODE_STATUS.
STATUS_S = 2.0
#: Slack for what was in flight when a lease ran out: frames in the socket buffers, one pass of
#: the node's loop, the head reading a fast stream behind.
GRACE_S = 1.0

def ended(g: Generation, *wanted: int) -> None:
    check(g.finish in wanted, f"finished {reason(g.finish)}, not {' or '.join(reason(w) for w in wanted)}")


def generated(ctx: Context, head: FleetHead, session: int, max_new: int) -> Generation:
    """A generation of `max_new` tokens that must end LENGTH (or EOS with fewer, off the mock).
    A Finish that never comes is first blamed on the events before it: a repeated seq hides a
    Finish from a head that drops repeats."""
    req = head.request(session, max_new)
    try:
        g = head.collect(req, timeout=ctx.target.timeout)
    except HeadTimeout:
        partial = head.generations.get((session, req.generation_id))
        if partial is not None:
            check_seqs(partial.events, req.epoch)
        raise
    if ctx.target.mock:
        ended(g, finish.LENGTH)
    else:
        ended(g, finish.LENGTH, finish.EOS)
    if g.finish == finish.LENGTH:
        check(len(g.tokens) == max_new, f"LENGTH after {len(g.tokens)} tokens of {max_new}")
    return g


def running(ctx: Context, head: FleetHead, session: int) -> GenerateReqMsg:
    """A long generation, once its first tokens have come."""
    req = head.request(session, LONG, LONG_WALL_MS)
    key = (session, req.generation_id)
    head.until(lambda: head.generations.get(key) and head.generations[key].tokens, ctx.target.timeout, "first tokens")
    return req


def hand_built(head: FleetHead, session: int, epoch: int) -> GenerateReqMsg:
    """A GENERATE_REQ the head's session would not build: any session, any epoch."""
    return GenerateReqMsg(
        command_id=head.session.next_command(session),
        session_id=session,
        epoch=epoch,
        generation_id=head.next_id(),
        budgets=GenerationBudgetsMsg(max_new_tokens=4, max_wall_ms=10_000),
        policy_ref=0,
    )


def declined(ctx: Context, head: FleetHead, req: GenerateReqMsg, why: str, timeout: float | None = None) -> None:
    """Sends `req` and checks the answer is one Finish DECLINED event, seq 0, the request's epoch."""
    key = (req.session_id, req.generation_id)
    before = len(head.generations[key].events) if key in head.generations else 0
    head.endpoint.send(msg_type.GENERATE_REQ, req)
    wait = ctx.target.timeout if timeout is None else timeout
    try:
        head.until(lambda: key in head.generations and len(head.generations[key].events) > before, wait, "answer")
    except HeadTimeout:
        raise Violation(f"{why}: no answer within {wait:g} s (a Rust head would wait forever)") from None
    except Closed:
        raise Violation(f"{why}: the node dropped the link instead of declining") from None
    ev = head.generations[key].events[before]
    got = ev.payload.reason if isinstance(ev.payload, TokenEventPayload.Finish) else None
    check(got == finish.DECLINED, f"{why}: answered {reason(got) if got is not None else ev.payload}, not DECLINED")
    check(ev.event_seq == 0 and ev.epoch == req.epoch, f"{why}: DECLINED as seq {ev.event_seq} epoch {ev.epoch}")


def check_stream(events: list[TokenEvent], epoch: int) -> None:
    """One generation's events as they arrived: seqs 0, 1, 2, ... each once, the assigned epoch,
    one Finish and nothing after it."""
    check_seqs(events, epoch)
    finishes = [i for i, e in enumerate(events) if isinstance(e.payload, TokenEventPayload.Finish)]
    check(finishes == [len(events) - 1], f"Finish events at positions {finishes} of {len(events)}")


def check_seqs(events: list[TokenEvent], epoch: int) -> None:
    """Events so far: seqs 0, 1, 2, ... each once, all of the generation's epoch."""
    seqs = [e.event_seq for e in events]
    for i, seq in enumerate(seqs):
        if seq != i:
            dup = seq in seqs[:i]
            raise Violation(f"event {i} has event_seq {seq}" + (" (sent twice)" if dup else "") + f": {seqs[:i + 1]}")
    epochs = {e.epoch for e in events} - {epoch}
    check(not epochs, f"events of epoch(s) {sorted(epochs)} in a generation of epoch {epoch}")


@scenario("generate-finish")
def generate_finish(ctx: Context) -> None:
    """A generation streams its tokens and ends with exactly one Finish (LENGTH, or EOS early)."""
    head = ctx.head()
    session, epoch = ctx.place(head, PROMPT)
    g = generated(ctx, head, session, 6)
    check_stream(g.events, epoch)


@scenario("event-seq")
def event_seq(ctx: Context) -> None:
    """A longer generation's events: seqs 0..n-1 each once, in order, all of the session's epoch."""
    head = ctx.head()
    session, epoch = ctx.place(head, PROMPT)
    g = generated(ctx, head, session, 40)
    check_stream(g.events, epoch)
    head.wal.assert_single_contiguous_streams()


@scenario("mock-tokens-exact", mock=True)
def mock_exact(ctx: Context) -> None:
    """Every generation equals the fleet mock's tokens (several prompts, seeds, max_new 0), and so
    does a stage forward."""
    head = ctx.head()
    cases = (([1, 2, 3], 0, 12), (list(range(500, 540)), 11, 33), ([7], 2**64 - 3, 5), ([4], 0, 0))
    for prompt, seed, max_new in cases:
        session = ctx.session()
        head.assign(session, GenParams(temperature=0.7, top_k=40, seed=seed))
        head.append(session, prompt)
        g = head.generate(session, max_new, timeout=ctx.target.timeout)
        ended(g, finish.LENGTH)
        want = mock_tokens(prompt, max_new, seed)
        check(g.tokens == want, f"prompt {prompt[:4]}... seed {seed}: tokens {g.tokens[:8]}... not {want[:8]}...")
    answer = head.stage([1, 2, 3], 0, MOCK_LAYERS, timeout=ctx.target.timeout)
    check(answer.token == mock_stage([1, 2, 3], 0, MOCK_LAYERS), f"stage token {answer.token}")


@scenario("mock-stage-exact", mock=True)
def mock_stage_exact(ctx: Context) -> None:
    """Stage forwards give the mock's hidden bytes and token, and [0,k) then [k,24) equals [0,24)."""
    head = ctx.head()
    tokens = [5, 6, 7, 8]
    whole = mock_stage(tokens, 0, MOCK_LAYERS)
    for k in (0, 1, 12, 23):
        first = head.stage(tokens, 0, k, timeout=ctx.target.timeout)
        check(first.hidden == mock_stage(tokens, 0, k) and first.token is None, f"[0,{k}) gave {first!r}")
        rest = head.stage([], k, MOCK_LAYERS, first.hidden, timeout=ctx.target.timeout)
        check(rest.token == whole and rest.hidden is None, f"[{k},24) gave {rest!r}, [0,24) is token {whole!r}")


@scenario("stage-bad-range-answered")
def stage_bad_range(ctx: Context) -> None:
    """A stage forward the node cannot run is answered empty, never left unanswered."""
    head = ctx.head()
    for start, end in ((5, 2), (0, 2**31)):
        try:
            answer = head.stage([1, 2, 3], start, end, timeout=ctx.target.timeout)
        except HeadTimeout:
            raise Violation(f"layers [{start},{end}): no answer (a Rust head would wait forever)") from None
        check(answer.hidden is None and answer.token is None, f"layers [{start},{end}) answered {answer}")


@scenario("cancel")
def cancel(ctx: Context) -> None:
    """GENERATE_CANCEL ends a running generation with CANCELLED, promptly."""
    head = ctx.head()
    session, epoch = ctx.place(head, PROMPT)
    req = running(ctx, head, session)
    head.cancel(req)
    try:
        g = head.collect(req, timeout=PROMPT_ANSWER_S)
    except HeadTimeout:
        raise Violation(f"still generating {PROMPT_ANSWER_S:g} s after GENERATE_CANCEL") from None
    ended(g, finish.CANCELLED)
    check_stream(g.events, epoch)
    if ctx.target.mock:
        check(g.tokens == mock_tokens(PROMPT, len(g.tokens)), "the tokens before the cancel are not the mock's")


@scenario("close-stops-generation")
def close_stops(ctx: Context) -> None:
    """A head that hangs up mid-generation frees its lane: the node's capacity soon shows no lane
    busy (the suite runs nothing else meanwhile)."""
    head = ctx.head()
    session, _ = ctx.place(head, PROMPT)
    running(ctx, head, session)
    head.close()
    watcher = ctx.head()
    if watcher.node.capacity.lanes_active == 0:
        return
    deadline = time.monotonic() + 2 * STATUS_S + GRACE_S
    while time.monotonic() < deadline:
        status = watcher.wait_for(msg_type.NODE_STATUS, STATUS_S + GRACE_S).msg
        if status.capacity.lanes_active == 0:
            return
    raise Violation(f"lanes still busy {2 * STATUS_S + GRACE_S:g} s after the head hung up")


@scenario("wall-budget-expired")
def wall_budget(ctx: Context) -> None:
    """A generation that outlives max_wall_ms ends FINISH_EXPIRED."""
    head = ctx.head()
    session, _ = ctx.place(head, PROMPT)
    g = head.generate(session, LONG, max_wall_ms=300, timeout=ctx.target.timeout)
    ended(g, finish.EXPIRED)


@scenario("refused-past-window")
def refused(ctx: Context) -> None:
    """A context longer than the announced window ends FINISH_REFUSED with no tokens; the link
    serves on."""
    if not ctx.window:
        skip("the node announces no context window")
    head = ctx.head()
    session, _ = ctx.place(head, [i % 1000 + 1 for i in range(ctx.window + 16)])
    g = head.generate(session, 4, timeout=ctx.target.timeout)
    ended(g, finish.REFUSED)
    check(g.tokens == [], f"a refused generation sent {len(g.tokens)} tokens")
    session, _ = ctx.place(head, PROMPT)
    generated(ctx, head, session, 4)


@scenario("decline-unknown-session")
def decline_unknown(ctx: Context) -> None:
    """A GENERATE_REQ for a session never placed is declined (Finish DECLINED, seq 0), not dropped."""
    head = ctx.head()
    declined(ctx, head, hand_built(head, ctx.session(), 7), "an unknown session")
    session, _ = ctx.place(head, PROMPT)
    generated(ctx, head, session, 4)


@scenario("decline-stale-epoch")
def decline_stale(ctx: Context) -> None:
    """A GENERATE_REQ at a superseded epoch is declined."""
    head = ctx.head()
    session, old = ctx.place(head, PROMPT)
    head.assign(session)
    head.append(session, PROMPT)
    declined(ctx, head, hand_built(head, session, old), "a superseded epoch")


@scenario("decline-replayed-command")
def decline_replayed(ctx: Context) -> None:
    """A GENERATE_REQ sent again with the same command id is declined, not run twice."""
    head = ctx.head()
    session, _ = ctx.place(head, PROMPT)
    req = head.request(session, 4)
    head.collect(req, timeout=ctx.target.timeout)
    declined(ctx, head, req, "a replayed command")


@scenario("decline-while-running")
def decline_running(ctx: Context) -> None:
    """A second GENERATE_REQ while one runs on the link is declined at once; the first goes on."""
    head = ctx.head()
    session, epoch = ctx.place(head, PROMPT)
    first = running(ctx, head, session)
    declined(ctx, head, hand_built(head, session, epoch), "a second generation", PROMPT_ANSWER_S)
    check(not head.finished((session, first.generation_id)), "the running generation ended with the decline")
    head.cancel(first)
    head.collect(first, timeout=ctx.target.timeout)


@scenario("revoke-then-declined")
def revoke(ctx: Context) -> None:
    """After SESSION_REVOKE the session is gone: a GENERATE_REQ for it is declined."""
    head = ctx.head()
    session, epoch = ctx.place(head, PROMPT)
    head.revoke(session)
    declined(ctx, head, hand_built(head, session, epoch), "a revoked session")


@scenario("append-replaces-context")
def append_replaces(ctx: Context) -> None:
    """APPEND_CONTENT replaces the whole context: the generation is the one of the last content."""
    head = ctx.head()
    final = [60, 61, 62, 63, 64, 65]
    session, _ = ctx.place(head, PROMPT)
    head.append(session, final)
    replaced = generated(ctx, head, session, 6)
    fresh, _ = ctx.place(head, final)
    check(replaced.tokens == generated(ctx, head, fresh, 6).tokens, "the replaced context generates otherwise")
    if ctx.target.mock:
        check(replaced.tokens == mock_tokens(final, 6), "not the mock's tokens for the last content")


@scenario("reassign-fences")
def reassign(ctx: Context) -> None:
    """A session placed again at a newer epoch serves the new epoch, same prompt, same tokens."""
    head = ctx.head()
    session, e1 = ctx.place(head, PROMPT)
    g1 = generated(ctx, head, session, 8)
    e2 = head.assign(session)
    head.append(session, PROMPT)
    g2 = generated(ctx, head, session, 8)
    check(g1.tokens == g2.tokens, "same prompt, another epoch, other greedy tokens")
    check({e.epoch for e in g2.events} == {e2}, f"events of epoch {e1} after the move to {e2}")


@scenario("status-periodic")
def status(ctx: Context) -> None:
    """NODE_STATUS comes every 2 s and agrees with HELLO_ACK_F on the node's fixed figures."""
    head = ctx.head()
    first = head.wait_for(msg_type.NODE_STATUS, 3.0)
    second = head.wait_for(msg_type.NODE_STATUS, 3.0)
    gap = second.at - first.at
    check(1.0 <= gap <= 3.0, f"two NODE_STATUS {gap:.2f} s apart, not about 2 s")
    hello = ctx.hello.capacity
    for got in (first.msg, second.msg):
        c = got.capacity
        check(got.loadable_models == ctx.hello.loadable_models, f"status names models {got.loadable_models}")
        check(c.max_context_tokens == hello.max_context_tokens, f"status window {c.max_context_tokens}")
        check(c.max_lanes == hello.max_lanes, f"status lanes {c.max_lanes}, hello {hello.max_lanes}")
        check(c.kv_blocks_used <= c.kv_blocks_total, f"kv blocks {c.kv_blocks_used}/{c.kv_blocks_total}")
    check(second.msg.capacity.sampled_at_ms > first.msg.capacity.sampled_at_ms, "sampled_at_ms did not advance")


def _renewals(head: FleetHead, session: int) -> list:
    return [r for r in head.of_type(msg_type.LEASE_RENEW) if r.msg.session_id == session]


@scenario("lease-renew")
def lease_renew(ctx: Context) -> None:
    """The node asks the connection that placed a session to renew its lease past renew_by, and
    only that one; a granted session outlives its first lease."""
    head, other = ctx.head(), ctx.head()
    placed = time.monotonic()
    session, epoch = ctx.place(head, PROMPT, lease=Lease(duration_ms=1500, renew_by_ms=500))
    head.until(lambda: _renewals(head, session), 1.5, "LEASE_RENEW before the lease ran out")
    asked = _renewals(head, session)[0]
    check(asked.msg.epoch == epoch, f"LEASE_RENEW for epoch {asked.msg.epoch}, not {epoch}")
    check(asked.at - placed >= 0.4, f"LEASE_RENEW {asked.at - placed:.2f} s after placing, before renew_by")
    head.idle(max(placed + 1.8 - time.monotonic(), 0))
    other.idle(0.05)
    check(not _renewals(other, session), "another connection was asked to renew the session")
    generated(ctx, head, session, 4)


@scenario("self-fence")
def self_fence(ctx: Context) -> None:
    """A session whose lease runs out ungranted is fenced: its generation sends nothing more, and
    a new GENERATE_REQ for it is declined."""
    head = ctx.head()
    head.grant_renewals = False
    lease = Lease(duration_ms=800, renew_by_ms=400)
    placed = time.monotonic()
    session, epoch = ctx.place(head, PROMPT, lease=lease)
    # Not waiting for its first tokens: a loaded node may not send any before the lease ends.
    head.request(session, LONG, LONG_WALL_MS)
    expiry = placed + lease.duration_ms / 1000
    head.idle(max(expiry + GRACE_S + 1.2 - time.monotonic(), 0))
    late = [
        e.event_seq
        for r in head.of_type(msg_type.TOKEN_EVENTS)
        if r.at > expiry + GRACE_S
        for e in r.msg.events
        if e.session_id == session
    ]
    check(not late, f"events {late[:5]} came more than {GRACE_S:g} s after the lease ran out")
    check(_renewals(head, session), "the node never asked to renew the lease")
    declined(ctx, head, hand_built(head, session, epoch), "a fenced session")
