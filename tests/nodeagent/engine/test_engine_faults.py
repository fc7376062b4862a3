"""The torch engine's faults in process (issue 30): failpoints as SUPERFLUID_FAILPOINTS spells
them, a step that raises, stalls, hangs or runs out of memory, and a scheduler that dies. The
same faults against a node process, over the wire, are rows of `make reliability`
(tests/reliability/engine_faults.py), run short by test_reliability_short.py."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from polling import background, wait_until
from tinymodel import TINY

from nodeagent import failpoints
from nodeagent.daemon import EngineFault, EngineHealth, GenExtras
from nodeagent.engine.builtin import random_model
from nodeagent.engine.torch_engine import TorchDaemon
from nodeagent.failpoints import Action, Failpoint, FailpointSpecError
from proto import finish
from proto.params import GenParams

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


@pytest.fixture
def make():
    daemons = []

    def build(spec: str = "", max_batch: int = 4, stall_timeout_ms: int = 0) -> TorchDaemon:
        model = random_model(TINY, seed=5, std=0.1)
        faults = failpoints.parse(spec) if spec else None
        daemon = TorchDaemon(
            model, "tiny", max_batch=max_batch, kv_blocks=256, stall_timeout_ms=stall_timeout_ms, faults=faults
        )
        daemons.append(daemon)
        return daemon

    yield build
    for daemon in daemons:
        daemon.close()


def run(daemon: TorchDaemon, prompt: list[int], max_tokens: int = 40, on_tokens=None):
    return daemon.generate_tokens_streaming(
        prompt, GenParams(), max_tokens, 0, GenExtras(), on_tokens or (lambda batch: True)
    )


@pytest.fixture(scope="module")
def expected() -> dict[tuple[int, ...], list[int]]:
    """Each prompt's 40 greedy tokens on an engine with no failpoint, one lane at a time."""
    model = random_model(TINY, seed=5, std=0.1)
    daemon = TorchDaemon(model, "tiny", max_batch=1, kv_blocks=256)
    try:
        return {tuple(p): list(run(daemon, p).tokens) for p in PROMPTS}
    finally:
        daemon.close()


def together(daemon: TorchDaemon, prompts: list[list[int]], max_tokens: int = 40) -> list:
    """Runs `prompts` at once; each one's result, or the error it raised."""
    def attempt(prompt):
        try:
            return run(daemon, prompt, max_tokens)
        except EngineFault as e:
            return e

    waits = [background(lambda p=p: attempt(p), timeout=60) for p in prompts]
    return [w() for w in waits]


# ---- the spec ---------------------------------------------------------------------------------


def test_the_spec_arms_each_point_at_its_pass():
    armed = failpoints.parse("engine.step=raise@3, engine.alloc=oom@1,engine.step=sleep(250)@5")
    assert armed.points == [
        Failpoint("engine.step", Action.RAISE, 3),
        Failpoint("engine.alloc", Action.OOM, 1),
        Failpoint("engine.step", Action.SLEEP, 5, ms=250),
    ]
    fired = [armed.hit("engine.step") for _ in range(6)]
    assert [None if p is None else p.action for p in fired] == [None, None, Action.RAISE, None, Action.SLEEP, None]
    assert armed.hit("engine.alloc").action == Action.OOM and armed.hit("engine.alloc") is None
    assert str(armed) == "engine.step=raise@3,engine.alloc=oom@1,engine.step=sleep(250)@5"


@pytest.mark.parametrize(
    "spec, says",
    [
        ("engine.step=raise", "NAME=ACTION@N"),
        ("engine.step=raise@0", "NAME=ACTION@N"),
        ("engine.nope=raise@1", "unknown failpoint 'engine.nope'"),
        ("engine.alloc=hang@1", "engine.alloc cannot 'hang'; it can oom"),
        ("engine.step=sleep@1", "sleep takes its milliseconds"),
        ("engine.step=raise(5)@1", "sleep takes its milliseconds"),
    ],
)
def test_a_spec_that_does_not_parse_is_refused_by_name(spec, says):
    with pytest.raises(FailpointSpecError, match=re.escape(says)):
        failpoints.parse(spec)


def test_unset_or_empty_arms_nothing():
    assert failpoints.from_env({}) is None
    assert failpoints.from_env({failpoints.ENV: " "}) is None
    assert failpoints.from_env({failpoints.ENV: "engine.scheduler=die@2"}).points[0].action == Action.DIE


# ---- faults in a step -------------------------------------------------------------------------


def test_a_step_that_raises_fails_its_generations_only(make, expected):
    # Two lanes for three generations: the one still queued at the 20th step is not in it.
    daemon = make("engine.step=raise@20", max_batch=2)
    results = together(daemon, PROMPTS[:3])
    failed = [r for r in results if isinstance(r, EngineFault)]
    assert 1 <= len(failed) <= 2 and all("failpoint engine.step=raise@20" in str(e) for e in failed)
    survivors = [(p, r) for p, r in zip(PROMPTS, results) if not isinstance(r, EngineFault)]
    assert survivors and all(list(r.tokens) == expected[tuple(p)] for p, r in survivors)
    assert daemon.health() == EngineHealth.OK
    assert list(run(daemon, PROMPTS[3]).tokens) == expected[tuple(PROMPTS[3])]
    assert wait_until(lambda: daemon.sched_stats().pool_blocks_used == 0)


def test_a_stalled_step_ends_its_generations_refuses_new_ones_and_recovers(make, expected):
    daemon = make("engine.step=sleep(2000)@5", stall_timeout_ms=400)
    began = time.monotonic()
    with pytest.raises(EngineFault, match="stalled"):
        run(daemon, PROMPTS[0])
    assert time.monotonic() - began < 0.4 + 1.0
    assert daemon.health() == EngineHealth.STALLED
    with pytest.raises(EngineFault, match="the engine is stalled"):
        run(daemon, PROMPTS[1])
    assert wait_until(lambda: daemon.health() == EngineHealth.OK, timeout=5)
    assert list(run(daemon, PROMPTS[1]).tokens) == expected[tuple(PROMPTS[1])]
    assert wait_until(lambda: daemon.sched_stats().lanes_active == 0)


def test_a_hung_step_ends_every_generation_and_close_does_not_wait_for_it(make):
    daemon = make("engine.step=hang@3", max_batch=1, stall_timeout_ms=300)
    results = together(daemon, PROMPTS[:3])
    assert all(isinstance(r, EngineFault) for r in results), results
    assert daemon.health() == EngineHealth.STALLED
    began = time.monotonic()
    daemon.close()
    assert time.monotonic() - began < 1.0


def test_a_step_past_the_timeout_with_no_watchdog_is_just_slow(make, expected):
    daemon = make("engine.step=sleep(600)@3", stall_timeout_ms=0)
    assert list(run(daemon, PROMPTS[0]).tokens) == expected[tuple(PROMPTS[0])]
    assert daemon.health() == EngineHealth.OK


# ---- the scheduler dies -----------------------------------------------------------------------


def test_a_dead_scheduler_ends_running_and_queued_generations_and_stays_failed(make):
    daemon = make("engine.scheduler=die@30", max_batch=1)
    results = together(daemon, PROMPTS[:3])
    assert all(isinstance(r, EngineFault) and "failpoint engine.scheduler=die@30" in str(r) for r in results)
    assert daemon.health() == EngineHealth.FAILED
    with pytest.raises(EngineFault, match="the engine failed"):
        run(daemon, PROMPTS[0])


# ---- out of memory ----------------------------------------------------------------------------


def test_out_of_memory_in_a_batched_step_preempts_lanes_and_every_generation_completes(make, expected, monkeypatch):
    daemon = make(max_batch=4)
    layer = daemon.model.layer
    fired = threading.Event()

    def short_of_memory(index, x, *args):
        if x.shape[0] == 4 and x.shape[1] == 1 and not fired.is_set():
            fired.set()
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return layer(index, x, *args)

    monkeypatch.setattr(daemon.model, "layer", short_of_memory)
    results = together(daemon, PROMPTS)
    assert fired.is_set()
    assert [list(r.tokens) for r in results] == [expected[tuple(p)] for p in PROMPTS]
    assert daemon._scheduler.preemptions >= 2


def test_the_alloc_failpoint_preempts_lanes_and_every_generation_completes(make, expected):
    # Four 3-5 token prompts take one block each at admission (allocations 1-4); the 7th
    # allocation is a lane growing into its second block, while all four decode.
    daemon = make("engine.alloc=oom@7", max_batch=4)
    results = together(daemon, PROMPTS)
    assert [list(r.tokens) for r in results] == [expected[tuple(p)] for p in PROMPTS]
    assert daemon._scheduler.preemptions >= 1


def test_out_of_memory_with_one_lane_fails_that_generation_only(make, expected):
    daemon = make("engine.alloc=oom@2", max_batch=1)
    with pytest.raises(EngineFault, match="out of memory"):
        run(daemon, PROMPTS[0])
    assert list(run(daemon, PROMPTS[1]).tokens) == expected[tuple(PROMPTS[1])]


def test_a_prefill_out_of_memory_fails_only_its_own_generation(make, expected, monkeypatch):
    daemon = make(max_batch=2)
    layer = daemon.model.layer
    long_prompt = list(range(1, 200))

    def short_of_memory(index, x, *args):
        if x.shape[1] >= 100:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return layer(index, x, *args)

    monkeypatch.setattr(daemon.model, "layer", short_of_memory)
    with pytest.raises(EngineFault, match="out of memory"):
        run(daemon, long_prompt)
    assert list(run(daemon, PROMPTS[2]).tokens) == expected[tuple(PROMPTS[2])]
