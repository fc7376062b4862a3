"""The batching scheduler through the daemon interface: KV freed on cancel, deadline and a
dropped callback; QoS queues; seeded sampling; counters; a failing step; close."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from types import SimpleNamespace

import pytest
from polling import background, wait_until
from tinymodel import TINY

from proto import finish
from nodeagent.daemon import GenerationError, GenExtras, StreamTooLong
from nodeagent.engine.builtin import random_model
from nodeagent.engine.scheduler import Generation, Scheduler
from nodeagent.engine.torch_engine import TorchDaemon
from proto.params import GenParams

GREEDY = GenParams()
SAMPLED = GenParams(temperature=1.0, top_p=0.95, min_p=0.01, top_k=100)


@pytest.fixture
def make():
    daemons = []

    def build(max_batch=8, kv_blocks=256, **kwargs) -> TorchDaemon:
        model = random_model(TINY, seed=5, std=0.1)
        daemons.append(TorchDaemon(model, "tiny", max_batch=max_batch, kv_blocks=kv_blocks, **kwargs))
        return daemons[-1]

    yield build
    for daemon in daemons:
        daemon.close()


def run(daemon, prompt=(1, 2, 3), params=GREEDY, max_tokens=16, deadline_ms=0, qos=0, on_tokens=None):
    return daemon.generate_tokens_streaming(
        list(prompt), params, max_tokens, deadline_ms, GenExtras(qos_class=qos), on_tokens or (lambda b: True)
    )


def in_threads(n: int, work) -> list:
    results: list = [None] * n

    def target(i: int) -> None:
        results[i] = work(i)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results



def pool_empty(daemon) -> bool:
    stats = daemon.sched_stats()
    return stats.pool_blocks_used == 0 and stats.lanes_active == 0


def admitted_or_queued(daemon) -> int:
    stats = daemon.sched_stats()
    return stats.lanes_active + sum(stats.queue_depth)


def decoded_until_freed(daemon) -> int:
    """Decode tokens the scheduler still ran, once the calls returned, before the pool emptied."""
    before = daemon.sched_stats().decode_tokens
    assert wait_until(lambda: pool_empty(daemon))
    return daemon.sched_stats().decode_tokens - before


#: Four lanes that stop: each may finish the step in flight, then its blocks are freed.
FREED_WITHIN_ONE_STEP = 4 * 2


def test_cancelled_generations_free_their_blocks(make):
    daemon = make()

    def cancel_after_three(i: int):
        seen = []

        def on_tokens(batch):
            seen.extend(batch)
            return len(seen) < 3

        return run(daemon, prompt=[i % 200 + 1] * (i % 40 + 1), max_tokens=200, on_tokens=on_tokens)

    results = []
    for _ in range(25):
        results += in_threads(4, cancel_after_three)
        assert decoded_until_freed(daemon) <= FREED_WITHIN_ONE_STEP
    assert len(results) == 100
    assert all(r.finish == finish.CANCELLED and len(r.tokens) >= 3 for r in results)
    assert daemon.sched_stats().pool_blocks_used == 0


def test_expired_generations_free_their_blocks(make):
    daemon = make()
    delivered = []

    def expire(i: int):
        return run(daemon, prompt=[i + 1] * 30, max_tokens=250, deadline_ms=15, on_tokens=lambda b: delivered.append(b) or True)

    results = []
    for _ in range(25):
        results += in_threads(4, expire)
        assert decoded_until_freed(daemon) <= FREED_WITHIN_ONE_STEP
    assert all(r.expired and r.tokens == [] and r.finish == finish.NONE for r in results)
    assert delivered, "the deadlines should fall mid-stream"
    assert daemon.sched_stats().pool_blocks_used == 0


def test_a_raising_callback_frees_the_lane_and_propagates(make):
    daemon = make()

    def dropped(batch):
        raise ConnectionResetError("peer went away")

    with pytest.raises(ConnectionResetError):
        run(daemon, max_tokens=200, on_tokens=dropped)
    assert decoded_until_freed(daemon) <= 2


def test_generation_waits_in_its_queue_for_a_lane_and_higher_class_goes_first(make):
    daemon = make(max_batch=1)
    order = []

    def first_token_logged(name):
        def on_tokens(batch):
            if name not in order:
                order.append(name)
            return True

        return on_tokens

    hog_started = threading.Event()
    hog_thread = threading.Thread(target=run, args=(daemon,), kwargs={"max_tokens": 200, "on_tokens": lambda b: hog_started.set() or True})
    hog_thread.start()
    assert hog_started.wait(10)
    background = threading.Thread(target=run, args=(daemon,), kwargs={"qos": 3, "on_tokens": first_token_logged("background")})
    background.start()
    assert wait_until(lambda: daemon.sched_stats().queue_depth[3] == 1)
    chat = threading.Thread(target=run, args=(daemon,), kwargs={"qos": 0, "on_tokens": first_token_logged("chat")})
    chat.start()
    assert wait_until(lambda: daemon.sched_stats().queue_depth == (1, 0, 0, 1))
    assert daemon.sched_stats().lanes_active == 1
    for thread in (hog_thread, chat, background):
        thread.join(30)
    assert order == ["chat", "background"]
    assert wait_until(lambda: pool_empty(daemon))


def test_a_prompt_the_pool_cannot_hold_beside_a_running_lane_waits_for_it(make):
    daemon = make(max_batch=2, kv_blocks=16)  # the pool holds one full window
    hog_started = threading.Event()
    hog = background(lambda: run(daemon, list(range(1, 101)), max_tokens=120, on_tokens=lambda b: hog_started.set() or True), timeout=30)
    assert hog_started.wait(10)
    whole_window = background(lambda: run(daemon, [7] * 250, max_tokens=4), timeout=30)
    assert wait_until(lambda: daemon.sched_stats().queue_depth[0] == 1)
    assert daemon.sched_stats().lanes_active == 1
    assert len(hog().tokens) == 120
    assert len(whole_window().tokens) == 4
    assert wait_until(lambda: pool_empty(daemon))


def test_a_deadline_passing_in_the_queue_leaves_the_queue(make):
    daemon = make(max_batch=1)
    holder = threading.Thread(target=run, args=(daemon,), kwargs={"max_tokens": 250})
    holder.start()
    assert wait_until(lambda: daemon.sched_stats().lanes_active == 1)
    result = run(daemon, deadline_ms=20, qos=2)
    assert result.expired
    assert daemon.sched_stats().queue_depth == (0, 0, 0, 0)
    holder.join(30)


def test_seeded_sampling_is_the_same_alone_or_batched(make):
    daemon = make()
    seeded = GenParams(temperature=0.9, top_p=0.9, min_p=0.02, top_k=64, seed=1234)
    alone = run(daemon, prompt=[9, 8, 7], params=seeded, max_tokens=48).tokens

    def mixed(i: int):
        if i == 0:
            return run(daemon, prompt=[9, 8, 7], params=seeded, max_tokens=48).tokens
        params = GREEDY if i % 2 else GenParams(temperature=1.3, seed=i)
        return run(daemon, prompt=[i] * (i * 3), params=params, max_tokens=48).tokens

    batched = in_threads(8, mixed)[0]
    other_seed = run(daemon, prompt=[9, 8, 7], params=GenParams(temperature=0.9, top_p=0.9, min_p=0.02, top_k=64, seed=1235), max_tokens=48).tokens
    assert batched == alone
    assert other_seed != alone
    greedy = run(daemon, prompt=[9, 8, 7], max_tokens=48).tokens
    assert alone != greedy


def test_decode_steps_batch_every_running_lane(make):
    daemon = make()
    widths = []
    forward = daemon._scheduler._forward

    forward_s = []

    def spy(gens, rows, counts):
        if not widths:  # hold the first step until every lane is admitted or queued behind it
            assert wait_until(lambda: admitted_or_queued(daemon) == 8)
        widths.append((len(gens), max(counts)))
        began = time.perf_counter()
        try:
            return forward(gens, rows, counts)
        finally:
            forward_s.append((max(counts), time.perf_counter() - began))

    daemon._scheduler._forward = spy
    before = daemon.sched_stats()
    results = in_threads(8, lambda i: run(daemon, prompt=[i + 1] * 5, max_tokens=32))
    after = daemon.sched_stats()
    assert all(len(r.tokens) == 32 for r in results)
    assert after.prefill_tokens - before.prefill_tokens == 8 * 5
    assert after.decode_tokens - before.decode_tokens == 8 * 31
    assert (8, 1) in widths, "the eight lanes should have shared decode steps"
    assert sum(b for b, width in widths if width == 1) == 8 * 31
    assert after.decode_steps - before.decode_steps == sum(width == 1 for _, width in widths)
    assert after.decode_seconds > before.decode_seconds
    in_forward = after.decode_forward_seconds - before.decode_forward_seconds
    assert sum(s for width, s in forward_s if width == 1) <= in_forward < after.decode_seconds - before.decode_seconds


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(make):
    daemon = make(prefill_chunk=16)
    steps = []
    forward = daemon._scheduler._forward

    def spy(gens, rows, counts):
        steps.append("prefill" if max(counts) > 1 or gens[0].prefilling else "decode")
        return forward(gens, rows, counts)

    daemon._scheduler._forward = spy
    started = threading.Event()
    runner = threading.Thread(target=run, args=(daemon,), kwargs={"max_tokens": 250, "on_tokens": lambda b: started.set() or True})
    runner.start()
    assert started.wait(10)
    steps.clear()
    result = run(daemon, prompt=list(range(1, 161)), max_tokens=4)
    runner.join(30)
    assert len(result.tokens) == 4
    prefill_at = [i for i, step in enumerate(steps) if step == "prefill"]
    assert len(prefill_at) == 10
    assert all(steps[i + 1] == "decode" for i in prefill_at[:-1]), steps


def test_limits_of_the_stream(make):
    daemon = make()
    window = daemon.max_stream_tokens()
    assert window == TINY.max_position_embeddings
    with pytest.raises(GenerationError, match="session has no content to generate from"):
        run(daemon, prompt=[])
    with pytest.raises(StreamTooLong) as caught:
        run(daemon, prompt=[1] * (window + 1))
    assert str(caught.value).startswith(f"this model's maximum context length is {window} tokens, but your request has {window + 1} tokens")
    full = run(daemon, prompt=[1] * window, max_tokens=10)
    assert len(full.tokens) == 1 and full.finish == finish.LENGTH
    assert run(daemon, max_tokens=0) == run(daemon, max_tokens=0)
    assert run(daemon, max_tokens=0).tokens == [] and run(daemon, max_tokens=0).finish == finish.LENGTH
    with pytest.raises(GenerationError, match="vocabulary"):
        run(daemon, prompt=[1, TINY.vocab_size])


def test_a_failing_step_fails_its_generations_and_the_scheduler_goes_on(make):
    daemon = make()
    layer = daemon.model.layer
    failing = threading.Event()
    failing.set()

    def flaky(*args):
        if failing.is_set():
            raise RuntimeError("simulated kernel failure")
        return layer(*args)

    daemon.model.layer = flaky
    with pytest.raises(GenerationError, match="simulated kernel failure"):
        run(daemon)
    assert wait_until(lambda: pool_empty(daemon))
    failing.clear()
    assert len(run(daemon).tokens) == 16


def test_close_cancels_running_generations(make):
    daemon = make()
    started = threading.Event()
    results = []
    runner = threading.Thread(target=lambda: results.append(run(daemon, max_tokens=250, on_tokens=lambda b: started.set() or True)))
    runner.start()
    assert started.wait(10)
    daemon.close()
    runner.join(10)
    assert results[0].finish == finish.CANCELLED
    with pytest.raises(GenerationError, match="closed"):
        run(daemon)


def test_close_waits_for_every_thread_the_scheduler_started_the_watchdog_mid_pass_included(make, monkeypatch):
    """A thread close leaves running drops the last reference to the model later: freeing its
    tensors while the interpreter exits aborted the process (std::terminate)."""
    before = set(threading.enumerate())
    daemon = make(stall_timeout_ms=400)
    started = [t for t in threading.enumerate() if t not in before]
    assert sorted(t.name for t in started) == ["torch-scheduler", "torch-watchdog"]
    in_pass = threading.Event()

    def slow_pass(now: float) -> None:  # a watchdog pass that is still running when close comes
        in_pass.set()
        time.sleep(0.3)

    monkeypatch.setattr(daemon._scheduler, "_check_stall", slow_pass)
    assert in_pass.wait(5)
    daemon.close()
    assert [t.name for t in started if t.is_alive()] == []


def test_prefill_serves_the_longest_waiting_lane_first_then_packs_short_ones():
    def waiting(admitted, prompt_len):
        gen = Generation(list(range(prompt_len)), 4, None, 0, None)
        gen.admitted = admitted
        return gen

    pick = functools.partial(Scheduler._pick_prefill, SimpleNamespace(prefill_chunk=512))
    long_prompt, shorts = waiting(0, 2000), [waiting(i, 10 * i) for i in (3, 1, 2)]
    assert [(g.admitted, c) for g, c in pick([*shorts, long_prompt])] == [(0, 512)]
    first, *_ = shorts
    first.admitted = -1
    assert [(g.admitted, c) for g, c in pick([*shorts, long_prompt])] == [(-1, 30), (1, 10), (2, 20)]
    assert pick([]) == []


def test_a_queued_generation_leaves_its_queue_at_once_when_its_caller_cancels(make):
    daemon = make(max_batch=1)
    gate, held = threading.Event(), threading.Event()
    decode_step = daemon._scheduler._decode_step

    def gated(gens):
        held.set()
        gate.wait(10)
        decode_step(gens)

    daemon._scheduler._decode_step = gated
    first = background(lambda: run(daemon, max_tokens=8), timeout=30)
    assert held.wait(5), "the first generation holds the only lane, its step held at the gate"
    cancel, result = threading.Event(), {}
    extras = GenExtras(cancel=cancel)
    waiter = threading.Thread(
        target=lambda: result.update(r=daemon.generate_tokens_streaming([4, 5], GREEDY, 8, 0, extras, lambda b: True))
    )
    waiter.start()
    assert wait_until(lambda: daemon.sched_stats().queue_depth[0] == 1)
    cancel.set()
    waiter.join(1.0)
    assert not waiter.is_alive(), "it waited for the lane instead of leaving the queue"
    assert result["r"].finish == finish.CANCELLED and result["r"].tokens == []
    assert daemon.sched_stats().queue_depth[0] == 0
    gate.set()
    assert first().finish == finish.LENGTH and len(first().tokens) == 8, "the running one went on untouched"
    assert wait_until(lambda: pool_empty(daemon))



def test_a_lane_whose_caller_stops_taking_tokens_stops_decoding_while_others_go_on():
    """The agent's worker blocks in `on_tokens` while its head is not reading: the lane holds
    back once `BACKLOG_TOKENS` wait untaken, instead of decoding its whole budget into memory,
    and the other lanes keep their pace."""
    from nodeagent.engine.scheduler import BACKLOG_TOKENS

    config = dataclasses.replace(TINY, max_position_embeddings=1024)
    daemon = TorchDaemon(random_model(config, seed=5, std=0.1), "tiny", max_batch=2, kv_blocks=256)
    release = threading.Event()

    def stuck(batch):
        release.wait(30)
        return True

    held = background(lambda: run(daemon, prompt=(7, 8), max_tokens=600, on_tokens=stuck), 60)
    other = run(daemon, prompt=(1, 2, 3), max_tokens=BACKLOG_TOKENS + 100)
    assert len(other.tokens) == BACKLOG_TOKENS + 100, "the other lane ran its whole budget meanwhile"
    decoded = daemon.sched_stats().decode_tokens
    assert decoded - len(other.tokens) <= BACKLOG_TOKENS + 2, "the held lane stopped at its backlog"
    release.set()
    try:
        assert len(held().tokens) == 600, "and went on to the end once its caller took tokens again"
        assert wait_until(lambda: pool_empty(daemon), 5)
    finally:
        daemon.close()


class Taker:
    """A connection's outbox as the consumer, noting which thread offers each batch, and a
    reader that takes what it was handed (or takes nothing while `paused`)."""

    def __init__(self) -> None:
        from linkf.waker import Waker
        from nodeagent.outbox import Outbox

        self.cancel = threading.Event()
        self.waker = Waker()
        self.outbox = Outbox(self.waker, self.cancel)
        self.threads: set[str] = set()
        self.tokens: list[int] = []
        post = self.outbox.post

        def noted(batch: list[int]) -> bool:
            self.threads.add(threading.current_thread().name)
            return post(batch)

        self.outbox.post = noted

    def take(self) -> None:
        self.tokens += self.outbox.take(1 << 20)[0]

    def generate(self, daemon, prompt, max_tokens: int):
        """Starts a greedy generation into this outbox on a thread; returns its `result()`."""
        self.ended = threading.Event()

        def body():
            try:
                return daemon.generate_tokens_streaming(list(prompt), GREEDY, max_tokens, 0, self.extras(), bool)
            finally:
                self.ended.set()

        return background(body, 60)

    def take_to_the_end(self) -> None:
        """Takes what comes until the generation has ended and nothing is left."""
        while not (self.ended.is_set() and not self.outbox.ready()):
            self.take()
            self.ended.wait(0.002)

    def extras(self) -> GenExtras:
        return GenExtras(cancel=self.cancel, consumer=self.outbox)


def test_a_consumer_that_takes_offers_gets_every_token_from_the_scheduler_thread(make):
    """No hop through the caller's thread: the scheduler offers each token to the outbox, the
    caller's `on_tokens` is never called, and the tokens are those a plain caller gets."""
    daemon = make()
    plain = run(daemon, prompt=(5, 6, 7), max_tokens=40)
    taker, called = Taker(), []
    try:
        result = daemon.generate_tokens_streaming([5, 6, 7], GREEDY, 40, 0, taker.extras(), called.append)
        taker.take()
    finally:
        taker.waker.close()
    assert called == [], "on_tokens is not used when the consumer takes offers"
    assert taker.threads == {"torch-scheduler"}
    assert taker.tokens == plain.tokens == result.tokens
    assert result.finish == plain.finish


def test_a_consumer_that_falls_behind_holds_its_lane_back_then_gets_the_rest(make):
    """Nobody takes from the outbox: the lane stops once the outbox is full (one token a step,
    so at most one past the bound) while another lane runs its whole budget; taking again lets
    it finish with every token in order."""
    from nodeagent.outbox import OUTBOX_SLOTS

    daemon = make(max_batch=2)
    taker = Taker()
    try:
        held = taker.generate(daemon, [9, 8], 200)
        assert wait_until(lambda: taker.outbox.behind(), 10)
        other = run(daemon, prompt=(1, 2, 3), max_tokens=150)
        assert len(other.tokens) == 150
        decoded = daemon.sched_stats().decode_tokens - len(other.tokens)
        assert decoded <= OUTBOX_SLOTS + 1, f"the held lane decoded {decoded} tokens past its outbox"
        assert not taker.ended.is_set()
        taker.take_to_the_end()
        result = held()
    finally:
        taker.waker.close()
    plain = run(daemon, prompt=(9, 8), max_tokens=200)
    assert taker.tokens == result.tokens == plain.tokens
    assert wait_until(lambda: pool_empty(daemon))


def test_a_consumer_that_refuses_stops_the_generation_and_frees_its_lane(make):
    """Once the generation is cancelled the outbox refuses the next post: the scheduler stops
    the lane at once, the call ends CANCELLED and the pool is empty."""
    daemon = make()
    taker = Taker()
    try:
        going = taker.generate(daemon, [3, 4], 10_000)
        assert wait_until(lambda: taker.outbox.ready())
        taker.cancel.set()
        result = going()
    finally:
        taker.waker.close()
    assert result.finish == finish.CANCELLED
    assert wait_until(lambda: pool_empty(daemon))
    assert daemon.sched_stats().lanes_active == 0


def test_the_scheduler_ends_a_cancelled_generation_so_its_caller_need_not_poll(make, monkeypatch):
    """With the caller's own look at its cancel event put off for a minute, setting the event
    still ends a queued generation and then a running one (whose tokens go to an outbox, so
    none wakes its caller) within a step or two: the scheduler's sweep ends them and so wakes
    their callers."""
    from nodeagent.engine import torch_engine

    monkeypatch.setattr(torch_engine, "CANCEL_POLL_S", 60.0)
    daemon = make(max_batch=1)
    config_window = daemon.max_stream_tokens()
    decode_step = daemon._scheduler._decode_step

    def slow_step(gens):  # the running generation outlasts the test on any machine
        time.sleep(0.02)
        decode_step(gens)

    daemon._scheduler._decode_step = slow_step
    taker, queued_cancel = Taker(), threading.Event()
    running_cancel = taker.cancel

    running = taker.generate(daemon, [1, 2], config_window - 8)
    assert wait_until(lambda: daemon.sched_stats().lanes_active == 1)
    queued = background(
        lambda: daemon.generate_tokens_streaming([3, 4], GREEDY, 8, 0, GenExtras(cancel=queued_cancel), bool), 30
    )
    assert wait_until(lambda: daemon.sched_stats().queue_depth[0] == 1)
    for cancel, result in ((queued_cancel, queued), (running_cancel, running)):
        t = time.monotonic()
        cancel.set()
        assert result().finish == finish.CANCELLED
        assert time.monotonic() - t < 2.0, "ended by the scheduler, not by the caller's next look"
    taker.waker.close()
    assert wait_until(lambda: pool_empty(daemon))


def test_a_lane_held_back_by_its_consumer_goes_to_a_generation_waiting_for_one(make):
    """One lane: a generation whose outbox nobody takes from is held back, and a second one
    waits. The held one gives up its lane (preempted, not cancelled), the second runs to its
    end, and once its consumer takes again the first comes back and ends with exactly the
    tokens it would have produced alone."""
    daemon = make(max_batch=1)
    taker = Taker()
    try:
        held = taker.generate(daemon, [9, 8], 150)
        assert wait_until(lambda: taker.outbox.behind(), 10)
        other = background(lambda: run(daemon, prompt=(1, 2, 3), max_tokens=40), 30)
        assert len(other().tokens) == 40, "the waiting generation got the held lane"
        assert daemon.sched_stats().queue_depth[0] == 1, "the held one waits in the queue meanwhile"
        assert not taker.ended.is_set()
        taker.take_to_the_end()
        result = held()
    finally:
        taker.waker.close()
    assert taker.tokens == result.tokens == run(daemon, prompt=(9, 8), max_tokens=150).tokens
    assert daemon._scheduler.preemptions >= 1
    assert wait_until(lambda: pool_empty(daemon))
