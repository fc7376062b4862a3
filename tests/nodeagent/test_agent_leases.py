"""Leases (node-behaviour.md §1.3): renewals are asked for only on the connection that owns a
session, again each second until granted; an expired lease fences its session, which then
goes silent."""

import logging
import time

from conformance.head import FleetHead
from conformance.reference import mock_tokens
from proto import finish
from nodeagent.engine.mock import MockDaemon
from proto.params import GenParams
from proto.linkf import Lease, LeaseGrantMsg, msg_type


def renewals(head: FleetHead, since: float = 0.0) -> list[tuple[float, int]]:
    return [(r.at, r.msg.session_id) for r in head.of_type(msg_type.LEASE_RENEW) if r.at >= since]


def pump_both(a: FleetHead, b: FleetHead, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        a.pump()
        b.pump()


def test_renewals_go_to_the_owner_and_are_asked_again_each_second_until_granted(node):
    short = Lease(duration_ms=60_000, renew_by_ms=200)
    with FleetHead.connect(node.addr) as a, FleetHead.connect(node.addr) as b:
        a.grant_renewals = False
        a.assign(1, GenParams(), short)
        b.assign(2, GenParams(), short)
        assigned = time.monotonic()
        pump_both(a, b, 1.5)

        asked_a = renewals(a)
        assert [sid for _, sid in asked_a] == [1, 1], f"one renewal, then one retry a second later: {asked_a}"
        assert 0.15 <= asked_a[0][0] - assigned <= 0.45
        assert 0.9 <= asked_a[1][0] - asked_a[0][0] <= 1.3, "the retry comes after RENEW_RETRY"
        asked_b = renewals(b)
        assert {sid for _, sid in asked_b} == {2}, "each connection hears only of its own sessions"
        assert len(asked_b) >= 4, "a granted lease is renewed again at its renew-by point, not after a second"

        # A grant by hand with a long renew-by stops the retries.
        epoch = a.session.current_epoch(1)
        grant = LeaseGrantMsg(session_id=1, epoch=epoch, duration_ms=60_000, renew_by_ms=50_000)
        a.endpoint.send(msg_type.LEASE_GRANT, grant)
        granted = time.monotonic()
        pump_both(a, b, 1.2)
        assert renewals(a, granted + 0.05) == []

        # Placed again over the other connection, the session's renewals follow it there.
        b.assign(1, GenParams(), short)
        moved = time.monotonic()
        pump_both(a, b, 0.5)
        assert 1 in {sid for _, sid in renewals(b, moved)}
        assert renewals(a, moved) == []


def test_an_expired_lease_fences_the_session_which_goes_silent(start_node, caplog):
    caplog.set_level(logging.WARNING, logger="nodeagent.agent")
    daemon = MockDaemon(token_delay_s=0.02)
    node = start_node(daemon)
    with FleetHead.connect(node.addr) as head:
        head.grant_renewals = False
        head.assign(1, GenParams(), Lease(duration_ms=500, renew_by_ms=100))
        head.append(1, [1, 2, 3])
        assigned = time.monotonic()
        req = head.request(1, 500)
        head.idle(1.0)

        fenced = [r for r in caplog.records if r.getMessage() == "node-agent self-fenced on lease expiry"]
        assert [r.fields for r in fenced] == [{"session_id": 1}]
        g = head.generations[(1, req.generation_id)]
        assert g.tokens, "tokens flowed before the fence"
        assert g.tokens == mock_tokens([1, 2, 3], len(g.tokens))
        assert g.finish is None, "a fenced session sends no Finish"
        last = max(r.at for r in head.of_type(msg_type.TOKEN_EVENTS))
        assert last - assigned < 0.5 + 0.25, "nothing is sent for a fenced session"
        asked = renewals(head)
        assert asked and all(at - assigned < 0.55 for at, _ in asked), "an expired lease is not renewed"

        until = time.monotonic() + 2.0
        while (node.agent.running_generations() or daemon.sched_stats().lanes_active) and time.monotonic() < until:
            head.pump()
        assert node.agent.running_generations() == 0, "the fenced run was dropped"
        assert daemon.sched_stats().lanes_active == 0, "and its generation stopped"
        assert 1 not in node.agent.shared.contexts and 1 not in node.agent.shared.owners

        again = head.generate(1, 4)
        assert again.finish == finish.DECLINED, "a fenced session takes no generation"

        head.assign(2, GenParams())
        head.append(2, [4, 5])
        assert head.generate(2, 4).tokens == mock_tokens([4, 5], 4), "the connection still serves"


def test_a_fenced_generation_that_has_sent_nothing_is_dropped_at_once(start_node):
    daemon = MockDaemon(max_lanes=1, token_delay_s=0.01)
    node = start_node(daemon)
    with FleetHead.connect(node.addr) as a, FleetHead.connect(node.addr) as b:
        a.assign(1, GenParams())
        a.append(1, [1])
        holding = a.request(1, 1000)  # takes the only lane
        a.until(lambda: daemon.sched_stats().lanes_active == 1, 2.0, "the lane taken")
        b.grant_renewals = False
        b.assign(2, GenParams(), Lease(duration_ms=300, renew_by_ms=100))
        b.append(2, [2])
        queued = b.request(2, 4)
        b.until(lambda: node.agent.running_generations() == 2, 2.0, "both generations running")
        b.until(lambda: node.agent.running_generations() == 1, 1.0, "the fenced run dropped")
        assert (2, queued.generation_id) not in b.generations, "it sent nothing"
        a.cancel(holding)
        assert a.collect(holding).finish == finish.CANCELLED
