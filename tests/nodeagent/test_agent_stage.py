"""Stage forwards (node-behaviour.md §1.9): run off the connection's thread, one at a time; a
second while one runs, or one the engine cannot run, is answered empty at once."""

import logging
import threading
import time

import pytest

from conformance.head import FleetHead
from conformance.reference import mock_stage, mock_tokens
from nodeagent.engine.mock import MockDaemon
from proto.params import GenParams

TOKENS = [5, 6, 7, 8]


class SlowStage(MockDaemon):
    """A stage that takes `seconds`, or until released."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.release = threading.Event()

    def forward_stage(self, tokens, start_layer, end_layer, hidden_in):
        self.release.wait(self.seconds)
        return super().forward_stage(tokens, start_layer, end_layer, hidden_in)


@pytest.mark.parametrize("split", [0, 1, 12, 23, 24])
def test_two_stages_give_the_token_of_one(node, split):
    with FleetHead.connect(node.addr) as head:
        whole = head.stage(TOKENS, 0, 24)
        assert (whole.hidden, whole.token) == (None, mock_stage(TOKENS, 0, 24))
        first = head.stage(TOKENS, 0, split)
        if split == 24:
            assert first.token == whole.token
            return
        assert first.token is None and first.hidden == mock_stage(TOKENS, 0, split)
        second = head.stage([], split, 24, first.hidden)
        assert (second.hidden, second.token) == (None, whole.token)


@pytest.mark.parametrize("start, end, hidden", [(3, 2, None), (0, 25, None), (5, 24, b"short")])
def test_a_stage_the_engine_cannot_run_is_answered_empty(node, start, end, hidden, caplog):
    caplog.set_level(logging.WARNING, logger="nodeagent.agent")
    with FleetHead.connect(node.addr) as head:
        answer = head.stage(TOKENS, start, end, hidden)
        assert (answer.hidden, answer.token) == (None, None)
        assert head.stage(TOKENS, 0, 24).token == mock_stage(TOKENS, 0, 24), "the connection serves on"
    (why,) = [r for r in caplog.records if r.getMessage().startswith("a stage forward the node could not run")]
    assert why.fields["start"] == start and str(why.fields["error"]), "the reason is logged, not dropped"


def test_a_second_stage_while_one_runs_is_answered_empty_at_once(start_node):
    daemon = SlowStage(5.0)
    node = start_node(daemon)
    with FleetHead.connect(node.addr) as head:
        head.assign(1, GenParams())
        head.append(1, TOKENS)
        first = head.send_stage(TOKENS, 0, 24)
        second = head.send_stage(TOKENS, 0, 24)
        busy = head.stage_answer(second, 2.0)
        assert (busy.hidden, busy.token) == (None, None)
        assert first not in head.stage_answers

        # The stage runs on a thread of its own: the connection still generates meanwhile.
        assert head.generate(1, 4).tokens == mock_tokens(TOKENS, 4)
        assert first not in head.stage_answers

        daemon.release.set()
        assert head.stage_answer(first, 2.0).token == mock_stage(TOKENS, 0, 24)
        started = time.monotonic()
        assert head.stage(TOKENS, 0, 24).token == mock_stage(TOKENS, 0, 24), "the slot is free again"
        assert time.monotonic() - started < 1.0


class CrashingStage(MockDaemon):
    """A stage whose engine fails with an error that is no DaemonError (a bug, a CUDA fault)."""

    def forward_stage(self, tokens, start_layer, end_layer, hidden_in):
        raise RuntimeError("the engine fell over")


def test_a_stage_whose_worker_crashes_is_still_answered(start_node, caplog):
    node = start_node(CrashingStage())
    with FleetHead.connect(node.addr) as head:
        answer = head.stage(TOKENS, 0, 24)
        assert (answer.hidden, answer.token) == (None, None), "the head has no stage timeout: silence wedges it"
        head.assign(1, GenParams())
        head.append(1, TOKENS)
        assert head.generate(1, 4).tokens == mock_tokens(TOKENS, 4), "the connection serves on"
    assert "the engine fell over" in caplog.text
