"""Generations (node-behaviour.md §1.5-1.8): declines, refusals, daemon errors, coalescing,
cancel, finish reasons, and a dropped connection stopping its generation."""

import logging
import threading
import time

import pytest
from helpers import placed

from conformance.head import FleetHead
from conformance.reference import mock_tokens
from proto import finish
from nodeagent.daemon import ConstraintError, GenerationError
from nodeagent.engine.mock import MockDaemon
from proto.params import GenParams
from proto.linkf import GenerateReqMsg, GenerationBudgetsMsg, TokenEventPayload, msg_type

PROMPT = list(range(100, 120))


class EndsEarly(MockDaemon):
    """A model that emits its end token after three tokens."""

    def generate_tokens_streaming(self, stream, params, max_tokens, deadline_ms, extras, on_tokens):
        return super().generate_tokens_streaming(stream, params, min(max_tokens, 3), deadline_ms, extras, on_tokens)


class NoGrammar(MockDaemon):
    def generate_tokens_streaming(self, stream, params, max_tokens, deadline_ms, extras, on_tokens):
        raise ConstraintError("this engine applies no grammar")


def by_hand(head: FleetHead, session_id: int, epoch: int, max_new: int = 4) -> GenerateReqMsg:
    """A GENERATE_REQ the head's own bookkeeping would not send."""
    req = GenerateReqMsg(
        command_id=head.session.next_command(session_id),
        session_id=session_id,
        epoch=epoch,
        generation_id=head.next_id(),
        budgets=GenerationBudgetsMsg(max_new_tokens=max_new, max_wall_ms=60_000),
    )
    head.endpoint.send(msg_type.GENERATE_REQ, req)
    return req


def assert_declined(head: FleetHead, req: GenerateReqMsg) -> None:
    g = head.collect(req, 5.0)
    assert g.tokens == []
    (ev,) = [e for e in g.events if isinstance(e.payload, TokenEventPayload.Finish)]
    assert (ev.payload.reason, ev.event_seq, ev.epoch) == (finish.DECLINED, 0, req.epoch)


def test_unknown_sessions_and_superseded_epochs_are_declined(node, caplog):
    caplog.set_level(logging.WARNING, logger="nodeagent.agent")
    with FleetHead.connect(node.addr) as head:
        assert_declined(head, by_hand(head, 404, epoch=1))
        old = placed(head, 1, PROMPT)
        new = head.assign(1, GenParams())
        assert_declined(head, by_hand(head, 1, epoch=old))
        assert new > old
        head.append(1, PROMPT)
        assert head.generate(1, 4).tokens == mock_tokens(PROMPT, 4), "the current epoch still serves"
    declines = [r.fields for r in caplog.records if r.getMessage().startswith("declining a generate")]
    assert {"session": 404, "generation": 1, "epoch": 1} in declines


def test_a_replayed_generate_is_declined_and_does_not_restart_the_stream(node):
    with FleetHead.connect(node.addr) as head:
        placed(head, 1, PROMPT)
        req = head.request(1, 8)
        g = head.collect(req)
        assert g.finish == finish.LENGTH
        events = len(g.events)
        head.endpoint.send(msg_type.GENERATE_REQ, req)  # the same command id again
        head.until(lambda: len(g.events) > events, 5.0, "an answer to the replay")
        (replayed,) = g.events[events:]
        assert replayed.payload == TokenEventPayload.Finish(reason=finish.DECLINED)
        assert replayed.event_seq == 0
        assert g.tokens == mock_tokens(PROMPT, 8)


def test_a_second_generate_on_a_busy_connection_is_declined_without_consuming_it(start_node):
    node = start_node(MockDaemon(token_delay_s=0.01))
    with FleetHead.connect(node.addr) as head:
        placed(head, 1, PROMPT)
        placed(head, 2, [7, 8, 9])
        first = head.request(1, 40)
        second = head.request(2, 4)
        assert_declined(head, second)
        running = head.generations.get((1, first.generation_id))
        assert running is None or running.finish is None, "declined while the first ran"
        assert head.collect(first).tokens == mock_tokens(PROMPT, 40)

        # Its command was not consumed: sent again, it runs (its stream starts over at seq 0).
        del head.generations[(2, second.generation_id)]
        head.endpoint.send(msg_type.GENERATE_REQ, second)
        retried = head.collect(second)
        assert (retried.finish, retried.tokens) == (finish.LENGTH, mock_tokens([7, 8, 9], 4))


def test_a_context_past_the_window_is_refused_and_the_connection_serves_on(start_node, caplog):
    caplog.set_level(logging.WARNING, logger="nodeagent.agent")
    node = start_node(MockDaemon(max_context=64))
    with FleetHead.connect(node.addr) as head:
        placed(head, 1, list(range(65)))
        g = head.generate(1, 8)
        assert (g.finish, g.tokens) == (finish.REFUSED, [])
        placed(head, 2, list(range(64)))
        assert head.generate(2, 4).tokens == mock_tokens(list(range(64)), 4), "exactly the window is served"
    (bug,) = [r for r in caplog.records if r.getMessage().startswith("refusing a generation")]
    assert "the head should have caught this before dispatch" in bug.getMessage()
    assert bug.fields["session"] == 1 and "maximum context length is 64" in str(bug.fields["error"])


def test_a_constraint_the_engine_cannot_apply_is_refused(start_node):
    node = start_node(NoGrammar())
    with FleetHead.connect(node.addr) as head:
        placed(head, 1, PROMPT)
        assert head.generate(1, 4).finish == finish.REFUSED


def test_any_other_daemon_error_ends_that_connection_only(node):
    with FleetHead.connect(node.addr) as good, FleetHead.connect(node.addr) as bad:
        placed(good, 1, PROMPT)
        bad.assign(2, GenParams())  # no content: the mock cannot generate
        bad.request(2, 4)
        assert bad.closed_by_node(3.0)
        outcome = node.outcome()
        assert isinstance(outcome, GenerationError)
        assert "session has no content to generate from" in str(outcome)
        assert good.generate(1, 4).tokens == mock_tokens(PROMPT, 4)
        assert node.agent.shared.agent.is_fenced(2) is False, "the failed connection's session survives"


def test_tokens_are_coalesced_by_count(node):
    with FleetHead.connect(node.addr) as head:
        placed(head, 1, PROMPT)
        g = head.generate(1, 40)
    assert g.tokens == mock_tokens(PROMPT, 40)
    batches = [len(e.payload.tokens) for e in g.events if isinstance(e.payload, TokenEventPayload.Tokens)]
    assert len(g.events) <= len(g.tokens) + 1
    assert len(batches) <= 4, f"40 instant tokens leave in few events: {batches}"
    assert max(batches) >= 16


def test_slow_tokens_leave_as_they_come(start_node):
    node = start_node(MockDaemon(token_delay_s=0.05))
    with FleetHead.connect(node.addr) as head:
        placed(head, 1, PROMPT)
        g = head.generate(1, 12)
        token_frames = [r.at for r in head.of_type(msg_type.TOKEN_EVENTS)]
    assert g.tokens == mock_tokens(PROMPT, 12)
    batches = [e for e in g.events if isinstance(e.payload, TokenEventPayload.Tokens)]
    assert len(batches) >= 2, "tokens leave as the engine makes them, not all at the end"
    assert token_frames[-1] - token_frames[0] >= 0.2


def test_cancel_stops_the_generation_and_finishes_cancelled(start_node):
    daemon = MockDaemon(token_delay_s=0.01)
    node = start_node(daemon)
    with FleetHead.connect(node.addr) as head:
        placed(head, 1, PROMPT)
        req = head.request(1, 1000)
        g = head.generations
        head.until(lambda: (1, req.generation_id) in g and g[(1, req.generation_id)].tokens, 5.0, "tokens")
        head.cancel(req)
        done = head.collect(req, 5.0)
        assert done.finish == finish.CANCELLED
        assert 0 < len(done.tokens) < 1000
        assert done.tokens == mock_tokens(PROMPT, len(done.tokens))
        head.until(lambda: daemon.sched_stats().lanes_active == 0, 2.0, "the lane freed")


@pytest.mark.parametrize(
    "daemon, max_new, wall_ms, reason",
    [
        (MockDaemon, 6, 60_000, finish.LENGTH),
        (EndsEarly, 6, 60_000, finish.EOS),
        (lambda: MockDaemon(token_delay_s=0.02), 500, 150, finish.EXPIRED),
    ],
    ids=["length", "eos", "expired"],
)
def test_finish_reasons(start_node, daemon, max_new, wall_ms, reason):
    node = start_node(daemon())
    with FleetHead.connect(node.addr) as head:
        placed(head, 1, PROMPT)
        g = head.generate(1, max_new, wall_ms)
    assert g.finish == reason
    assert g.tokens == mock_tokens(PROMPT, len(g.tokens))
    if reason == finish.EOS:
        assert len(g.tokens) == 3


def test_closing_the_connection_stops_its_generation(start_node):
    daemon = MockDaemon(token_delay_s=0.01)
    node = start_node(daemon)
    head = FleetHead.connect(node.addr)
    placed(head, 1, PROMPT)
    req = head.request(1, 1000)
    head.until(lambda: (1, req.generation_id) in head.generations, 5.0, "the first tokens")
    head.close()
    assert node.outcome() is None, "a head hanging up is no error"
    deadline = time.monotonic() + 2.0
    while daemon.sched_stats().lanes_active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert daemon.sched_stats().lanes_active == 0, "the generation stopped with its connection"
    assert node.agent.running_generations() == 0
    assert daemon.sched_stats().decode_tokens < 1000



class Crashes(MockDaemon):
    """An engine with a bug: its worker dies without a result."""

    def generate_tokens_streaming(self, stream, params, max_tokens, deadline_ms, extras, on_tokens):
        raise RuntimeError("engine bug")


def test_a_worker_that_dies_without_a_result_ends_the_connection(start_node, caplog):
    node = start_node(Crashes())
    with FleetHead.connect(node.addr) as head:
        placed(head, 1, PROMPT)
        head.request(1, 4)
        assert head.closed_by_node(3.0)
    outcome = node.outcome()
    assert isinstance(outcome, GenerationError) and "ended without a result" in str(outcome)
    assert node.agent.running_generations() == 0 and node.agent.shared.load.busy.running == 0
    assert "engine bug" in caplog.text, "the cause is logged, not lost with the worker"


def test_a_cancel_reaches_a_generation_still_waiting_for_a_lane_at_once(start_node):
    """One lane, held by another connection's long generation: a head that cancels its queued
    generation gets its Finish now, not when the lane frees."""
    daemon = MockDaemon(max_lanes=1, token_delay_s=0.01)
    node = start_node(daemon)
    with FleetHead.connect(node.addr) as busy, FleetHead.connect(node.addr) as waiting:
        placed(busy, 1, PROMPT)
        long_run = busy.request(1, 1000)
        busy.until(lambda: daemon.sched_stats().lanes_active == 1, 5.0, "the lane taken")
        placed(waiting, 2, PROMPT)
        queued = waiting.request(2, 8)
        waiting.until(lambda: daemon.sched_stats().queue_depth[0] == 1, 5.0, "the second one queued")
        started = time.monotonic()
        waiting.cancel(queued)
        done = waiting.collect(queued, 5.0)
        assert done.finish == finish.CANCELLED and done.tokens == []
        assert time.monotonic() - started < 1.0, "the cancel waited for the lane"
        assert daemon.sched_stats().queue_depth[0] == 0
        key = (1, long_run.generation_id)
        busy.until(lambda: key in busy.generations and busy.generations[key].tokens, 5.0, "tokens")
        assert busy.generations[key].finish is None, "the running one goes on"
        busy.cancel(long_run)
        assert busy.collect(long_run, 5.0).finish == finish.CANCELLED


def test_a_worker_that_cannot_start_leaves_no_generation_counted(node, monkeypatch):
    """A process out of threads ends the connection with the reason, and neither the drain's
    count nor the busy time keeps the generation that never ran."""
    real_start = threading.Thread.start

    def no_worker(thread):
        if thread.name == "node-generation":
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", no_worker)
    with FleetHead.connect(node.addr) as head:
        placed(head, 1, PROMPT)
        head.request(1, 8)
        assert head.closed_by_node(5.0)
    assert isinstance(node.outcome(), GenerationError)
    assert node.agent.running_generations() == 0 and node.agent.shared.load.busy.running == 0
