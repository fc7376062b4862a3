"""The Rust fleet scenarios (fleet_one_node, fleet_recovery, fleet_concurrency, fleet_wedge),
and reconcile after a reconnect (linkf-wire.md §7): what a head sees across connections."""

from __future__ import annotations

import threading

from conformance.checks_serve import PROMPT, generated
from conformance.head import LEASE, clock_id
from conformance.raw import raw_connect
from conformance.reference import mock_tokens
from conformance.scenario import Context, Violation, check, scenario
from proto import finish
from proto.linkf import TokenEvent, msg_type

HEADS = 4


@scenario("reconcile-held-resume")
def reconcile_held(ctx: Context) -> None:
    """After a reconnect, RECONCILE finds the session held, nothing is committed twice, and the
    next generation is the one before (fleet_recovery)."""
    head = ctx.head()
    session, _ = ctx.place(head, PROMPT)
    g1 = generated(ctx, head, session, 8)
    committed = head.wal.total_committed()
    ack = head.reconnect(ctx.target.timeout)
    check([s.held for s in ack.sessions if s.session_id == session] == [True], f"RECONCILE_ACK says {ack.sessions}")
    check(head.wal.total_committed() == committed, "the reconnect committed events again")
    check(generated(ctx, head, session, 8).tokens == g1.tokens, "the resumed session generates otherwise")
    head.wal.assert_single_contiguous_streams()


@scenario("reconcile-unknown-not-held")
def reconcile_unknown(ctx: Context) -> None:
    """RECONCILE of a session the node never had: held false, nothing to send again."""
    head = ctx.head()
    unknown = ctx.session()
    head.session.assign_session(unknown, clock_id(), LEASE)
    ack = head.reconnect(ctx.target.timeout)
    (state,) = [s for s in ack.sessions if s.session_id == unknown]
    check(not state.held and not state.retry_ranges, f"an unknown session reconciled as {state}")


def _resent(head, start: int, session: int) -> list[TokenEvent]:
    return [e for r in head.received[start:] if r.frame.msg_type == msg_type.TOKEN_EVENTS for e in r.msg.events
            if e.session_id == session]


@scenario("reconcile-retransmits-unacked")
def reconcile_retransmits(ctx: Context) -> None:
    """After a reconnect the node sends again exactly the events nobody acknowledged, unchanged,
    and never one the head acknowledged."""
    head = ctx.head()
    session, _ = ctx.place(head, PROMPT)
    generated(ctx, head, session, 6)
    head.lose_events = True
    lost = head.request(session, 20)
    key = (session, lost.generation_id)
    head.until(lambda: head.finished(key), ctx.target.timeout, "the Finish of the generation whose acks are lost")
    originals = {e.event_seq: e for e in head.generations[key].events}
    acked = dict(head.acked)
    head.lose_events = False
    start = len(head.received)
    ack = head.reconnect(ctx.target.timeout)
    head.idle(0.2)
    for e in _resent(head, start, session):
        if e.event_seq <= acked.get((e.session_id, e.epoch, e.generation_id), -1):
            raise Violation(f"sent again generation {e.generation_id} event {e.event_seq}, already acknowledged")
    (state,) = [s for s in ack.sessions if s.session_id == session]
    ranges = [(r.generation_id, r.from_seq, r.to_seq) for r in state.retry_ranges]
    check(ranges == [(lost.generation_id, 0, max(originals))], f"retry ranges {ranges}, not 0..{max(originals)}")
    again = {e.event_seq: e for e in _resent(head, start, session) if e.generation_id == lost.generation_id}
    check(again == originals, "the events sent again differ from the first sending")
    head.wal.assert_single_contiguous_streams()


@scenario("fleet-concurrent-heads")
def concurrent_heads(ctx: Context) -> None:
    """Four heads generating at once on one node each get their own tokens (fleet_concurrency)."""
    prompts = [[i * 7 + 1, i * 7 + 2, i * 7 + 3, 99] for i in range(HEADS)]
    results: dict[int, list[int] | BaseException] = {}

    def one(i: int) -> None:
        try:
            head = ctx.head()
            session, _ = ctx.place(head, prompts[i])
            results[i] = generated(ctx, head, session, 12).tokens
        except BaseException as e:  # reported below, on the scenario's thread
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(HEADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(ctx.target.timeout * 2)
    check(not any(t.is_alive() for t in threads), "a head is still waiting")
    for i in range(HEADS):
        got = results[i]
        if isinstance(got, BaseException):
            raise got
    alone = ctx.head()
    for i, prompt in enumerate(prompts):
        if ctx.target.mock:
            want = mock_tokens(prompt, 12)
        else:
            want = generated(ctx, alone, ctx.place(alone, prompt)[0], 12).tokens
        check(results[i] == want, f"head {i} got other tokens than {'the mock' if ctx.target.mock else 'alone'}")


@scenario("fleet-second-head-same-session")
def second_head(ctx: Context) -> None:
    """A later head placing a session another head used is answered (tokens or DECLINED), never
    left waiting, and its link serves on (fleet_one_node)."""
    first = ctx.head()
    session, _ = ctx.place(first, PROMPT)
    for _ in range(2):
        generated(ctx, first, session, 4)
    first.close()
    second = ctx.head()
    second.assign(session)
    second.append(session, PROMPT)
    g = second.generate(session, 4, timeout=ctx.target.timeout)
    check(g.finish == finish.DECLINED or len(g.tokens) == 4, f"finished {g.finish} after {len(g.tokens)} tokens")
    generated(ctx, second, ctx.place(second, PROMPT)[0], 4)


@scenario("fleet-silent-peer-no-wedge")
def silent_peer(ctx: Context) -> None:
    """A connection that never says anything does not keep the node from serving a head
    (fleet_wedge)."""
    with raw_connect(ctx.target.addr, ctx.target.timeout):
        head = ctx.head()
        session, _ = ctx.place(head, PROMPT)
        generated(ctx, head, session, 8)
