"""NodeMetrics, its HTTP server and StoryLog in process: health codes, the exposition, the
busy line (issue 12). The process tests are in test_metrics.py."""

from __future__ import annotations

import logging
import socket

import pytest
from helpers import http_get
from polling import wait_until

from proto import finish
from nodeagent.daemon import EngineHealth
from nodeagent.engine.mock import MockDaemon
from nodeagent.metrics import MetricsServer, NodeMetrics
from nodeagent.observe import Observers
from nodeagent.story import StoryLog


@pytest.fixture
def served():
    metrics = NodeMetrics("n1", "9.9.9")
    server = MetricsServer(metrics, socket.AF_INET, ("127.0.0.1", 0))
    server.start()
    yield metrics, "127.0.0.1:%d" % server.address()[1]
    server.close()


def test_readiness_follows_the_node_state_and_liveness_does_not(served):
    metrics, addr = served
    assert http_get(addr, "/health") == (200, "loading\n")
    assert http_get(addr, "/ready") == (503, "loading\n")
    metrics.node_state("serving")
    assert http_get(addr, "/health") == (200, "serving\n")
    assert http_get(addr, "/ready") == (200, "serving\n")
    metrics.node_state("draining")
    assert http_get(addr, "/health") == (200, "draining\n")
    assert http_get(addr, "/ready") == (503, "draining\n")
    assert http_get(addr, "/nope")[0] == 404


class _Engine(MockDaemon):
    """A mock whose health the test sets."""

    state = EngineHealth.OK

    def health(self) -> EngineHealth:
        return self.state


@pytest.mark.parametrize("state", [EngineHealth.STALLED, EngineHealth.FAILED])
def test_an_engine_that_makes_no_progress_fails_both_probes_and_recovers(served, state):
    metrics, addr = served
    engine = _Engine()
    metrics.serve_engine(engine, 8, "mock")
    metrics.node_state("serving")
    engine.state = state
    assert http_get(addr, "/health") == (503, f"{state.value}\n")
    assert http_get(addr, "/ready") == (503, f"{state.value}\n")
    stalled = f"superfluid_node_engine_stalled {1.0 if state == EngineHealth.STALLED else 0.0}"
    assert stalled in http_get(addr, "/metrics")[1]
    engine.state = EngineHealth.OK
    assert http_get(addr, "/health") == (200, "serving\n")
    assert http_get(addr, "/ready") == (200, "serving\n")
    assert "superfluid_node_engine_stalled 0.0" in http_get(addr, "/metrics")[1]


def test_engine_figures_appear_once_an_engine_is_served(served):
    metrics, addr = served
    assert "superfluid_node_kv_blocks_total" not in http_get(addr, "/metrics")[1]
    metrics.serve_engine(MockDaemon(max_lanes=3), 3, "mock")
    text = http_get(addr, "/metrics")[1]
    assert "superfluid_node_kv_blocks_total 1024.0" in text
    assert "superfluid_node_lanes_max 3.0" in text
    assert 'superfluid_node_generations_queued{qos_class="background"} 0.0' in text
    assert 'superfluid_node_info{identity="n1",model="mock",version="9.9.9"} 1.0' in text
    assert "_created" not in text


def test_the_decode_step_summaries_are_the_schedulers_count_and_wall_times(served):
    from nodeagent.daemon import SchedStats

    class Stepped(MockDaemon):
        def sched_stats(self) -> SchedStats:
            return SchedStats(decode_steps=40, decode_seconds=1.25, decode_forward_seconds=1.0)

    metrics, addr = served
    metrics.serve_engine(Stepped(max_lanes=2), 2, "mock")
    text = http_get(addr, "/metrics")[1]
    assert "# TYPE superfluid_node_decode_step_seconds summary" in text
    assert "superfluid_node_decode_step_seconds_count 40.0" in text
    assert "superfluid_node_decode_step_seconds_sum 1.25" in text
    assert "superfluid_node_decode_forward_seconds_count 40.0" in text
    assert "superfluid_node_decode_forward_seconds_sum 1.0" in text


def test_a_generation_dropped_without_a_finish_stops_counting_as_running():
    metrics = NodeMetrics("n1", "1")
    watch = Observers(metrics).generation_started(1, 1, 10)
    watch.tokens_sent(3)
    watch.tokens_sent(2)
    watch.dropped()
    watch.dropped()
    assert metrics.running._value.get() == 0
    assert metrics.generation_tokens._value.get() == 5
    assert metrics.itl._sum.get() >= 0 and metrics.ttft._sum.get() >= 0
    done = Observers(metrics).generation_started(1, 2, 4)
    done.finished(finish.EOS)
    done.dropped()  # the connection lets go of it after its Finish: counted once
    assert metrics.running._value.get() == 0
    assert metrics.finished.labels("eos")._value.get() == 1


def test_the_busy_line_comes_while_generations_run(caplog):
    caplog.set_level(logging.INFO, logger="nodeagent.story")
    story = StoryLog(MockDaemon(), 8, status_every_s=0.05)
    try:
        watch = story.generation_started(1, 1, 5)
        watch.tokens_sent(4)
        assert wait_until(lambda: any(r.getMessage() == "busy" for r in caplog.records), 5)
        busy = next(r for r in caplog.records if r.getMessage() == "busy")
        assert busy.fields["generations"] == 1 and busy.fields["lanes"] == "0/8"
        caplog.clear()
        watch.finished(finish.LENGTH)
        finished = [r for r in caplog.records if r.getMessage() == "generation finished"]
        assert finished[0].fields["tokens"] == 4 and finished[0].fields["reason"] == "length"
    finally:
        story.close()
