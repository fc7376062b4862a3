"""The Rust `fleet_concurrency` scenarios, and a heavier one: many heads and generations at
once, every output token-exact, and nothing left running afterwards."""

import threading
import time

from conformance.head import LEASE, FleetHead
from conformance.reference import mock_tokens
from nodeagent.engine.mock import MockDaemon
from proto.params import GenParams

JOIN = 30.0


def run_all(jobs) -> list:
    """Runs each job on its own thread, released together; their results in order."""
    barrier = threading.Barrier(len(jobs))
    results: list = [None] * len(jobs)

    def run(k: int) -> None:
        try:
            results[k] = jobs[k](barrier)
        except BaseException as e:  # reported by the caller's assertion
            results[k] = e

    threads = [threading.Thread(target=run, args=(k,), name=f"test-head-{k}") for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
    assert not any(t.is_alive() for t in threads), "a head is still waiting"
    return results


def one_generation(addr: str, session: int, prompt: list[int], max_new: int, connect_first: bool):
    def job(barrier: threading.Barrier) -> list[int]:
        if not connect_first:
            barrier.wait(5)
        with FleetHead.connect(addr) as head:
            head.assign(session, GenParams())
            head.append(session, prompt)
            if connect_first:
                barrier.wait(5)
            return head.generate(session, max_new, timeout=20).tokens

    return job


def test_concurrent_generations_across_distinct_nodes(start_node):
    nodes = [start_node(idle_s=2.0, identity="node-multi") for _ in range(4)]
    prompts = [list(range(i * 50, i * 50 + 20)) for i in range(4)]
    jobs = [one_generation(n.addr, 1, p, 16, connect_first=True) for n, p in zip(nodes, prompts)]
    for i, got in enumerate(run_all(jobs)):
        assert got == mock_tokens(prompts[i], 16), f"node {i} diverged under concurrent load"


def test_concurrent_heads_to_one_node_are_all_served(start_node):
    node = start_node(idle_s=2.0, identity="node-shared")
    prompts = [list(range(i * 7 + 1, i * 7 + 15)) for i in range(4)]
    jobs = [one_generation(node.addr, i + 1, p, 12, connect_first=False) for i, p in enumerate(prompts)]
    for i, got in enumerate(run_all(jobs)):
        assert got == mock_tokens(prompts[i], 12), f"head {i} got wrong output from the shared node"


def test_concurrent_generations_on_one_node_use_a_connection_each(start_node):
    node = start_node(MockDaemon(token_delay_s=0.002), identity="pool-node")
    prompt = list(range(24))
    jobs = [one_generation(node.addr, s + 1, prompt, 32, connect_first=True) for s in range(4)]
    for got in run_all(jobs):
        assert got == mock_tokens(prompt, 32), "every concurrent generation is served"
    assert node.opened == 4


def test_eight_connections_with_four_generations_each_leave_nothing_behind(start_node):
    before = set(threading.enumerate())
    daemon = MockDaemon(max_lanes=8, token_delay_s=0.003)
    node = start_node(daemon)
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], daemon.sched_stats().lanes_active)

    watcher = threading.Thread(target=watch, name="test-watch")
    watcher.start()

    def head_job(k: int):
        def job(barrier: threading.Barrier) -> list[tuple[list[int], list[int]]]:
            with FleetHead.connect(node.addr) as head:
                barrier.wait(5)
                out = []
                for g in range(4):
                    session = k * 10 + g
                    prompt = [k, g, *range(30 + k, 60)]
                    head.assign(session, GenParams(seed=k), LEASE)
                    head.append(session, prompt)
                    out.append((head.generate(session, 24 + g, timeout=20).tokens, mock_tokens(prompt, 24 + g, seed=k)))
                    head.revoke(session)
                return out

        return job

    results = run_all([head_job(k) for k in range(8)])
    done.set()
    watcher.join(JOIN)
    for k, result in enumerate(results):
        assert not isinstance(result, BaseException), f"head {k}: {result!r}"
        for got, want in result:
            assert got == want, f"head {k} diverged"
    assert peak[0] >= 4, f"the generations did not overlap (at most {peak[0]} lanes at once)"

    def settled() -> bool:
        with node.agent.shared.lock:
            held = bool(node.agent.shared.contexts)
        return not (held or node.agent.running_generations() or daemon.sched_stats().lanes_active)

    deadline = time.monotonic() + 5
    while not settled() and time.monotonic() < deadline:  # the last revokes may be in flight
        time.sleep(0.01)
    assert node.agent.running_generations() == 0
    stats = daemon.sched_stats()
    assert (stats.pool_blocks_used, stats.lanes_active) == (0, 0)
    assert node.agent.shared.load.busy.running == 0
    assert node.agent.shared.contexts == {}, "every session was revoked"
    node.stop()
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], f"threads left behind: {left}"
