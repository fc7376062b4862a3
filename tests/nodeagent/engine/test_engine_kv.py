"""KV blocks on demand: preemption when the pool runs dry, QoS order, and the prefix cache
across a session's turns, all without changing a token."""

from __future__ import annotations

import threading

import pytest
import torch
from polling import wait_until
from test_engine_parity import PROMPTS, is_reference_greedy
from test_engine_scheduler import in_threads
from tinymodel import TINY

from proto import finish
from nodeagent.daemon import GenExtras
from nodeagent.engine.builtin import DictSource, random_tensors
from nodeagent.engine.kvpool import blocks_for
from nodeagent.engine.model import LlamaModel
from nodeagent.engine.torch_engine import TorchDaemon
from proto.params import GenParams

LONG = 190  # max_tokens: with the longest prompt, near the 256-token window
WORST_CASE_BLOCKS = blocks_for(max(len(p) for p in PROMPTS) + LONG - 1)


@pytest.fixture(scope="module")
def tensors():
    return random_tensors(TINY, seed=11, std=0.1)


@pytest.fixture
def make(tensors):
    daemons = []

    def build(kv_blocks: int, **kwargs) -> TorchDaemon:
        """An fp32 pool unless told otherwise: the reference computes in float64, and an fp16
        pool's rounding would flip its near-ties."""
        model = LlamaModel.from_source(TINY, DictSource(tensors), torch.float32, torch.device("cpu"))
        daemons.append(TorchDaemon(model, "tiny", kv_blocks=kv_blocks, **{"kv_dtype": torch.float32, **kwargs}))
        return daemons[-1]

    yield build
    for daemon in daemons:
        daemon.close()


GREEDY = GenParams()


def run(daemon, prompt, max_tokens, params=GREEDY, qos=0, on_tokens=None):
    return daemon.generate_tokens_streaming(
        list(prompt), params, max_tokens, 0, GenExtras(qos_class=qos), on_tokens or (lambda b: True)
    )


def all_reference_greedy(tensors, prompts, results, max_tokens: int = LONG) -> bool:
    return all(
        len(r.tokens) == max_tokens and is_reference_greedy(tensors, TINY, p, r.tokens)
        for p, r in zip(prompts, results, strict=True)
    )


def decode_widths(daemon) -> list[int]:
    """Records how many lanes each decode step ran."""
    widths: list[int] = []
    forward = daemon._scheduler._forward

    def spy(gens, rows, counts):
        if max(counts) == 1:
            widths.append(len(gens))
        return forward(gens, rows, counts)

    daemon._scheduler._forward = spy
    return widths


def test_a_pool_for_two_worst_cases_runs_eight_long_generations_token_exact(make, tensors):
    daemon = make(kv_blocks=2 * WORST_CASE_BLOCKS, max_batch=8, prefill_chunk=64)
    widths = decode_widths(daemon)
    results = in_threads(len(PROMPTS), lambda i: run(daemon, PROMPTS[i], LONG))
    assert all_reference_greedy(tensors, PROMPTS, results)
    assert all(r.finish == finish.LENGTH for r in results)
    assert max(widths) > 2, "worst-case reservation would run two at once"
    assert daemon._scheduler.preemptions > 0, "the pool should have run dry"
    assert wait_until(lambda: daemon.sched_stats().pool_blocks_used == 0)
    assert daemon.sched_stats().lanes_active == 0


def test_an_fp16_pool_gives_each_of_eight_preempted_generations_the_tokens_it_gets_alone(make):
    """What `--kv-dtype auto` picks where the node's CPU kernels attend: each key and value is
    rounded once, when stored, and read back the same in any batch, chunk or recompute."""
    alone = make(kv_blocks=256, max_batch=1, kv_dtype=torch.float16)
    if alone._scheduler.attention_kernels is None:
        pytest.skip("the node's CPU kernels do not attend here")
    want = [run(alone, p, LONG).tokens for p in PROMPTS]
    tight = make(kv_blocks=2 * WORST_CASE_BLOCKS, max_batch=8, prefill_chunk=64, kv_dtype=torch.float16)
    results = in_threads(len(PROMPTS), lambda i: run(tight, PROMPTS[i], LONG))
    assert tight._scheduler.preemptions > 0, "the pool should have run dry"
    assert [r.tokens for r in results] == want
    assert tight._scheduler.pool.kv.dtype == torch.float16


def test_seeded_sampling_survives_preemption(make):
    seeded = [GenParams(temperature=1.0, top_p=0.9, seed=100 + i) for i in range(4)]
    n = 80
    roomy = make(kv_blocks=256, max_batch=4)
    alone = [run(roomy, PROMPTS[i], n, seeded[i]).tokens for i in range(4)]
    tight = make(kv_blocks=2 * blocks_for(max(map(len, PROMPTS[:4])) + n - 1), max_batch=4)
    together = in_threads(4, lambda i: run(tight, PROMPTS[i], n, seeded[i]).tokens)
    assert tight._scheduler.preemptions > 0
    assert together == alone


def test_a_higher_class_preempts_lower_class_lanes_for_its_blocks(make, tensors):
    daemon = make(kv_blocks=WORST_CASE_BLOCKS + 2, max_batch=4)
    started = threading.Event()
    background = [None, None]

    def bulk(i: int) -> None:
        background[i] = run(daemon, PROMPTS[i + 4], LONG, qos=3, on_tokens=lambda b: started.set() or True)

    threads = [threading.Thread(target=bulk, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    assert started.wait(10)
    assert wait_until(lambda: daemon.sched_stats().pool_blocks_used >= WORST_CASE_BLOCKS - 2, 30)
    victims = preempted_classes(daemon)
    chat = run(daemon, PROMPTS[2], LONG, qos=0)
    during_chat = list(victims)
    for thread in threads:
        thread.join(60)
    assert all_reference_greedy(tensors, [PROMPTS[2], *PROMPTS[4:6]], [chat, *background])
    assert during_chat and set(during_chat) == {3}, "only the class-3 lanes give way to the chat"


def preempted_classes(daemon) -> list[int]:
    """Records the QoS class of every generation the scheduler preempts from now on."""
    classes: list[int] = []
    preempt = daemon._scheduler._preempt

    def spy(gen):
        classes.append(gen.qos)
        preempt(gen)

    daemon._scheduler._preempt = spy
    return classes


def conversation(daemon, turns: list[list[int]], reply_tokens: int) -> list[list[int]]:
    """A chat session as a head drives it: each turn's prompt is the last prompt, its reply
    and the next message."""
    context: list[int] = []
    replies = []
    for message in turns:
        context += message
        reply = run(daemon, context, reply_tokens).tokens
        replies.append(reply)
        context += reply
    return replies


TURNS = [[(37 * i + 11) % 250 + 3 for i in range(n)] for n in (70, 9, 23, 16)]
REPLY = 24


def test_a_conversation_reuses_its_prefix_and_gets_the_same_tokens(make):
    cached, uncached = make(kv_blocks=64), make(kv_blocks=64, prefix_cache=False)
    replies = conversation(cached, TURNS, REPLY)
    assert replies == conversation(uncached, TURNS, REPLY)
    prompts = [sum(map(len, TURNS[: k + 1])) + REPLY * k for k in range(len(TURNS))]
    assert uncached.sched_stats().prefill_tokens == sum(prompts)
    assert uncached._scheduler.reused_tokens == 0
    reused = cached._scheduler.reused_tokens
    # every turn after the first finds all the last turn computed (its prompt and all but the
    # last token of its reply) but the partial block at the end
    computed_before = [prompts[k - 1] + REPLY - 1 for k in range(1, len(TURNS))]
    assert reused > sum(n - 16 for n in computed_before)
    assert cached.sched_stats().prefill_tokens + reused == sum(prompts)
    assert wait_until(lambda: cached.sched_stats().pool_blocks_used == 0)


def test_a_whole_prompt_in_the_cache_still_computes_its_last_block(make):
    daemon = make(kv_blocks=64)
    prompt = list(range(1, 33))  # two full blocks
    first = run(daemon, prompt, 8).tokens
    before = daemon.sched_stats().prefill_tokens
    assert run(daemon, prompt, 8).tokens == first
    assert daemon.sched_stats().prefill_tokens - before == 16


def test_cached_blocks_give_way_when_the_pool_needs_them(make, tensors):
    daemon = make(kv_blocks=blocks_for(256))
    for prompt in PROMPTS[:4]:
        run(daemon, prompt, 40)
    pool = daemon._scheduler.pool
    assert pool.cached > 0 and pool.used == 0
    assert all_reference_greedy(tensors, PROMPTS[4:5], [run(daemon, PROMPTS[4], LONG)])
    assert wait_until(lambda: daemon.sched_stats().pool_blocks_used == 0)
