"""The mock engine against mock-engine.md, checked against the conformance kit's reference
(`conformance.reference`), written from the spec and independent of the engine."""

import dataclasses
import struct
import threading
import time
from array import array

import pytest
import xxhash
from polling import wait_until

from conformance.reference import mock_stage, mock_tokens
from proto import finish
from nodeagent.daemon import (
    GenerationError,
    GenerationResult,
    GenExtras,
    StageError,
    StageHidden,
    StageToken,
    StreamTooLong,
)
from nodeagent.engine.mock import POOL_BLOCKS, MockDaemon
from proto.params import GenParams


def generate(daemon, prompt, n, seed=0, deadline_ms=0, on_tokens=None, batches=None):
    def collect(batch):
        if batches is not None:
            batches.append(list(batch))
        return True if on_tokens is None else on_tokens(batch)

    return listed(daemon.generate_tokens_streaming(prompt, GenParams(seed=seed), n, deadline_ms, GenExtras(), collect))


def listed(result: GenerationResult) -> GenerationResult:
    """`result` with its tokens as a list, to compare with the reference's lists."""
    return dataclasses.replace(result, tokens=list(result.tokens))


PROMPTS = [[1], list(range(500, 540)), [31999, 0, 7, 2**32 - 1], list(range(300))]
PROMPT4 = [1, 2, 3, 4]


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"len{len(p)}")
@pytest.mark.parametrize("seed", [0, 42, 2**64 - 3])
def test_tokens_match_the_reference(prompt, seed):
    result = generate(MockDaemon(), prompt, 37, seed=seed)
    assert result.tokens == mock_tokens(prompt, 37, seed)
    assert result.finish == finish.NONE and not result.expired


def test_a_known_value_pins_the_hash_itself():
    # XXH3-64 of LE32(1) ++ LE64(1) is the first token after the prompt [1] with seed 0.
    data = struct.pack("<IQ", 1, 1)
    assert generate(MockDaemon(), [1], 1).tokens == [xxhash.xxh3_64_intdigest(data) % 32000]


@pytest.mark.parametrize("batch", [1, 7, 1024])
def test_the_counter_wraps_past_u64_within_and_between_batches(batch):
    seed = 2**64 - 30  # after a 4-token prompt the counter starts 26 short of the wrap
    assert generate(MockDaemon(batch_tokens=batch), PROMPT4, 60, seed=seed).tokens == mock_tokens(PROMPT4, 60, seed)


@pytest.mark.parametrize("batch", [1, 3, 16, 100])
def test_callback_batch_sizes_change_no_value(batch):
    batches = []
    result = generate(MockDaemon(batch_tokens=batch), PROMPTS[1], 40, seed=5, batches=batches)
    assert result.tokens == mock_tokens(PROMPTS[1], 40, 5)
    assert sum(batches, []) == result.tokens
    assert all(len(b) == batch for b in batches[:-1]) and 0 < len(batches[-1]) <= batch


def test_concurrent_generations_each_match_their_reference():
    daemon = MockDaemon(max_lanes=3)
    jobs = [(list(range(i, i + 10 + i)), i * 7) for i in range(8)]
    results = [None] * len(jobs)

    def run(i):
        results[i] = generate(daemon, jobs[i][0], 50, seed=jobs[i][1]).tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for (prompt, seed), tokens in zip(jobs, results, strict=True):
        assert tokens == mock_tokens(prompt, 50, seed)
    stats = daemon.sched_stats()
    assert stats.decode_tokens == 50 * len(jobs)
    assert stats.prefill_tokens == sum(len(p) for p, _ in jobs)
    assert stats.lanes_active == 0 and stats.pool_blocks_used == 0 and sum(stats.queue_depth) == 0


def test_sampling_knobs_change_nothing():
    params = GenParams(temperature=0.7, top_p=0.9, min_p=0.1, top_k=40, seed=9)
    result = MockDaemon().generate_tokens_streaming(
        PROMPTS[1], params, 20, 0, GenExtras(qos_class=3), lambda b: True
    )
    assert list(result.tokens) == mock_tokens(PROMPTS[1], 20, 9)


def test_zero_max_tokens_returns_nothing_at_once():
    calls = []
    result = generate(MockDaemon(), [5, 6], 0, on_tokens=lambda b: calls.append(b) or True)
    assert (result.tokens, result.finish, result.expired, calls) == ([], finish.NONE, False, [])


def test_the_window_edge():
    daemon = MockDaemon(max_context=64)
    assert generate(daemon, list(range(64)), 3).tokens == mock_tokens(list(range(64)), 3, 0)
    with pytest.raises(StreamTooLong) as e:
        generate(daemon, list(range(65)), 3)
    assert str(e.value) == (
        "this model's maximum context length is 64 tokens, but your request has 65 tokens; "
        "shorten the prompt or drop earlier turns"
    )
    assert daemon.max_stream_tokens() == 64


def test_an_empty_stream_is_a_generation_error():
    with pytest.raises(GenerationError, match="^session has no content to generate from$"):
        generate(MockDaemon(), [], 3)


def test_the_deadline_expires_a_slow_generation():
    daemon = MockDaemon(token_delay_s=0.02)
    start = time.monotonic()
    result = generate(daemon, [1, 2, 3], 10_000, deadline_ms=150)
    assert (result.tokens, result.finish, result.expired) == ([], finish.NONE, True)
    assert 0.14 <= time.monotonic() - start < 2
    assert daemon.sched_stats().lanes_active == 0


def test_a_deadline_not_reached_changes_nothing():
    result = generate(MockDaemon(), [1, 2, 3], 30, deadline_ms=60_000)
    assert result.tokens == mock_tokens([1, 2, 3], 30, 0) and not result.expired


def test_a_callback_returning_false_cancels_at_once():
    seen = []
    result = generate(MockDaemon(batch_tokens=1), PROMPTS[1], 100, on_tokens=lambda b: seen.append(b) or len(seen) < 5)
    assert result.finish == finish.CANCELLED
    assert len(seen) == 5 and result.tokens == mock_tokens(PROMPTS[1], 5, 0)


def test_the_delay_holds_a_generation_open_and_close_ends_it():
    daemon = MockDaemon(token_delay_s=0.05)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", generate(daemon, list(range(40)), 10_000)))
    t.start()
    assert wait_until(lambda: daemon.sched_stats().decode_tokens >= 3)
    stats = daemon.sched_stats()
    assert stats.lanes_active == 1 and 3 <= stats.pool_blocks_used <= 4  # 40 tokens + a few: 3 pages
    daemon.close()
    t.join(timeout=5)
    assert not t.is_alive() and out["r"].finish == finish.CANCELLED
    assert out["r"].tokens == mock_tokens(list(range(40)), len(out["r"].tokens), 0)


def test_pool_pages_follow_the_resident_lanes_and_return_to_zero():
    daemon = MockDaemon(batch_tokens=1)
    used = []
    prompt = list(range(15))

    def watch(batch):
        used.append(daemon.sched_stats().pool_blocks_used)
        return True

    generate(daemon, prompt, 20, on_tokens=watch)
    # context 16 after the first token (1 page), 17 after the second (2 pages), 35 at the end (3).
    assert used[0] == 1 and used[1] == 2 and used[-1] == 3
    stats = daemon.sched_stats()
    assert stats.pool_blocks_used == 0 and stats.pool_blocks_total == POOL_BLOCKS == 1024


def test_lanes_beyond_max_wait_in_the_queue():
    daemon = MockDaemon(max_lanes=1, token_delay_s=0.02)
    threads = [threading.Thread(target=generate, args=(daemon, [i + 1], 15)) for i in range(3)]
    for t in threads:
        t.start()
    assert wait_until(lambda: daemon.sched_stats().queue_depth[0] == 2)
    stats = daemon.sched_stats()
    assert stats.lanes_active == 1 and stats.queue_depth[0] == 2
    for t in threads:
        t.join(timeout=10)
    stats = daemon.sched_stats()
    assert stats.lanes_active == 0 and sum(stats.queue_depth) == 0 and stats.decode_tokens == 45


@pytest.mark.parametrize("tokens", [[1, 2, 3], list(range(100, 164)), []])
def test_stage_chains_agree_with_the_whole_range(tokens):
    daemon = MockDaemon()
    whole = daemon.forward_stage(tokens, 0, 24, None)
    assert whole == StageToken(mock_stage(tokens, 0, 24))
    for k in range(0, 25):
        first = daemon.forward_stage(tokens, 0, k, None)
        if k == 24:
            assert first == whole
            continue
        assert first == StageHidden(mock_stage(tokens, 0, k))
        assert daemon.forward_stage([], k, 24, first.data) == whole


def test_stage_three_pieces_and_the_hidden_input_ignores_tokens():
    daemon = MockDaemon()
    a = daemon.forward_stage([9, 8, 7], 0, 5, None)
    b = daemon.forward_stage([1, 1, 1], 5, 17, a.data)
    assert daemon.forward_stage([], 17, 24, b.data) == daemon.forward_stage([9, 8, 7], 0, 24, None)


@pytest.mark.parametrize(
    "start,end,hidden",
    [(5, 4, None), (0, 25, None), (3, 30, None), (0, 4, b"\x00" * 7), (2, 4, b"\x00" * 9), (0, 4, b"")],
)
def test_stage_errors(start, end, hidden):
    with pytest.raises(StageError):
        MockDaemon().forward_stage([1, 2], start, end, hidden)


def test_identity():
    daemon = MockDaemon(max_context=2048, max_lanes=3)
    assert daemon.model_name == "mock"
    assert daemon.summary() == "runtime mock, context window 2048 tokens, 3 lanes"


def test_a_queued_generation_leaves_its_queue_at_once_when_its_caller_cancels():
    daemon = MockDaemon(max_lanes=1, token_delay_s=0.01)
    holder = threading.Thread(target=generate, args=(daemon, [1], 100))
    holder.start()
    assert wait_until(lambda: daemon.sched_stats().lanes_active == 1)
    cancel, result = threading.Event(), {}
    extras = GenExtras(cancel=cancel)
    waiter = threading.Thread(
        target=lambda: result.update(r=daemon.generate_tokens_streaming([2], GenParams(), 5, 0, extras, lambda b: True))
    )
    waiter.start()
    assert wait_until(lambda: daemon.sched_stats().queue_depth[0] == 1)
    cancel.set()
    waiter.join(timeout=0.5)
    assert not waiter.is_alive(), "it waited for a lane instead of leaving the queue"
    assert listed(result["r"]) == GenerationResult([], finish.CANCELLED)
    assert daemon.sched_stats().queue_depth[0] == 0 and daemon.sched_stats().lanes_active == 1
    holder.join(timeout=10)
    assert daemon.sched_stats().decode_tokens == 100, "the running generation went on untouched"


def test_a_result_keeps_its_tokens_at_four_bytes_each():
    """As the run kept them: a list of a 1M-token stream would take 36 MB when it ends."""
    result = MockDaemon().generate_tokens_streaming([1], GenParams(), 5000, 0, GenExtras(), lambda b: True)
    assert isinstance(result.tokens, array) and result.tokens.itemsize == 4
    assert list(result.tokens) == mock_tokens([1], 5000)
