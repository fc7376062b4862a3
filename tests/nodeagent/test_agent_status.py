"""NODE_STATUS and capacity (node-behaviour.md §1.3 and "Capacity"): a status every 2 s, and
decode/prefill rates that are an EWMA over busy time only."""

import time
from dataclasses import dataclass

from conformance.head import FleetHead
from conformance.reference import mock_tokens
from nodeagent.agent import NodeAgent
from nodeagent.daemon import SchedStats
from nodeagent.engine.mock import MockDaemon
from proto.params import GenParams
from proto.linkf import msg_type


def test_node_status_every_two_seconds_with_busy_time_rates(start_node):
    daemon = MockDaemon(token_delay_s=0.01)
    node = start_node(daemon, max_lanes=3)
    with FleetHead.connect(node.addr) as head:
        head.assign(1, GenParams())
        head.append(1, list(range(32)))
        assert head.generate(1, 50).tokens == mock_tokens(list(range(32)), 50)
        head.until(lambda: len(head.of_type(msg_type.NODE_STATUS)) == 2, 5.0, "two statuses")
    statuses = head.of_type(msg_type.NODE_STATUS)
    gap = statuses[1].at - statuses[0].at
    assert 1.9 <= gap <= 2.4, gap
    first, second = statuses[0].msg, statuses[1].msg
    assert 1900 <= second.capacity.sampled_at_ms - first.capacity.sampled_at_ms <= 2300

    cap = first.capacity
    assert first.loadable_models == ["mock"]
    assert (cap.max_lanes, cap.max_context_tokens, cap.active_sessions) == (3, 4096, 1)
    assert (cap.kv_blocks_total, cap.kv_blocks_used, cap.lanes_active, cap.queue_depth) == (1024, 0, 0, 0)
    assert (first.mem.pool_blocks_total, first.mem.pool_blocks_used) == (1024, 0)
    # 50 tokens took about 0.5 s of busy time: a rate over busy time reads about 100 tokens/s,
    # where one over the 2 s of wall time would read 25.
    assert 45 <= cap.decode_tokens_per_s <= 110, cap.decode_tokens_per_s
    assert cap.prefill_tokens_per_s > 0
    assert second.capacity.decode_tokens_per_s == cap.decode_tokens_per_s, "idle time does not decay the rate"


@dataclass
class Counters(MockDaemon):
    """A daemon whose counters the test sets."""

    decoded: int = 0
    prefilled: int = 0

    def __post_init__(self):
        super().__init__()

    def sched_stats(self) -> SchedStats:
        return SchedStats(decode_tokens=self.decoded, prefill_tokens=self.prefilled, pool_blocks_total=1024)


def test_rates_are_an_ewma_of_busy_time_samples():
    daemon = Counters()
    agent = NodeAgent(daemon, "node", "mock")
    busy = agent.shared.load.busy

    def rates(busy_ms: int, decoded: int, prefilled: int) -> tuple[int, int]:
        busy.total += busy_ms / 1000
        daemon.decoded += decoded
        daemon.prefilled += prefilled
        cap = agent.capacity()
        return cap.decode_tokens_per_s, cap.prefill_tokens_per_s

    assert rates(0, 0, 0) == (0, 0), "the first sample only sets the baseline"
    assert rates(500, 100, 50) == (200, 100), "the first rate is taken as is"
    assert rates(500, 300, 0) == ((3 * 200 + 600) // 4, 100), "then 3/4 old plus 1/4 new; zero skipped"
    assert rates(100, 1000, 1000) == (300, 100), "under 200 ms of busy time nothing is sampled"
    assert rates(150, 0, 0) == ((3 * 300 + 4000) // 4, (3 * 100 + 4000) // 4), "…and it accumulates"


def test_busy_time_counts_only_while_something_runs():
    agent = NodeAgent(MockDaemon(), "node", "mock")
    busy = agent.shared.load.busy
    busy.start()
    busy.start()
    time.sleep(0.05)
    busy.stop()
    time.sleep(0.05)
    busy.stop()
    time.sleep(0.1)
    assert 90 <= busy.ms() <= 150
