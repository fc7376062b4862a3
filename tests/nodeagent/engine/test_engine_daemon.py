"""The builtin model and the stage forward through the daemon interface."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import greedy
import torch
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.daemon import ModelLoadError, StageError, StageHidden, StageToken
from nodeagent.engine import open_engine
from nodeagent.engine.builtin import BUILTIN_CONFIG, BUILTIN_SEED, builtin_model, random_tensors
from nodeagent.engine.cpu_kernels import cpu_kernels
from nodeagent.engine.torch_engine import TorchDaemon, scheduler_threads, serving_threads

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def builtin():
    daemon = open_engine("torch", "builtin", device="cpu", max_batch=4, kv_budget_mb=64)
    yield daemon
    daemon.close()


def test_builtin_is_small_fast_to_build_and_always_the_same():
    started = time.monotonic()
    model = builtin_model(torch.float32, CPU)
    assert time.monotonic() - started < 3.0
    params = model.weight_bytes() / 4
    assert 15e6 < params < 25e6
    assert model.config.vocab_size == 32000
    again = builtin_model(torch.float32, CPU)
    assert torch.equal(model.layers[3].input_norm, again.layers[3].input_norm)
    assert torch.equal(model.embedding, again.embedding)


def test_builtin_daemon_describes_itself_and_generates(builtin):
    assert builtin.model_name == "builtin"
    assert builtin.max_stream_tokens() == 2048
    described = re.fullmatch(
        r"runtime torch \(builtin, llama, cpu fp32\), context window 2048 tokens, 4 lanes, (\d+) CPU threads?, "
        r"weights 69 MB float \(a float checkpoint\), kv pool (\d+) blocks of 16 tokens \(64 MB (fp16|fp32), "
        r"taken as used(, attended in place on the node's (AVX2|AVX-512 VNNI) kernels)?\), \d+ MB free",
        builtin.summary(),
    )
    assert int(described.group(1)) == torch.get_num_threads()
    attended = described.group(4) is not None
    assert attended == (cpu_kernels() is not None)
    # The pool holds fp16 where the kernels attend: twice the blocks in the same budget.
    assert (described.group(2), described.group(3)) == (("819", "fp16") if attended else ("409", "fp32"))
    tokens = greedy(builtin, [1, 450, 4996, 17354], 8)
    assert len(tokens) == 8 and all(0 <= t < 32000 for t in tokens)
    assert greedy(builtin, [1, 450, 4996, 17354], 8) == tokens


def test_stage_zero_layers_is_the_embedding_on_the_wire(builtin):
    out = builtin.forward_stage([5, 6, 7], 0, 0, None)
    assert isinstance(out, StageHidden)
    rows = np.frombuffer(out.data, dtype="<f4").reshape(3, BUILTIN_CONFIG.hidden_size)
    embedding = random_tensors(BUILTIN_CONFIG, BUILTIN_SEED)["model.embed_tokens.weight"]
    assert np.array_equal(rows, embedding[[5, 6, 7]].numpy())


def test_stage_chain_of_several_hops_gives_the_whole_token(builtin):
    prompt = [1, 450, 4996, 17354, 1701, 29916]
    whole = builtin.forward_stage(prompt, 0, 10, None)
    assert whole == StageToken(greedy(builtin, prompt, 1)[0])
    hidden = builtin.forward_stage(prompt, 0, 3, None).data
    hidden = builtin.forward_stage([], 3, 7, hidden).data
    assert len(hidden) == len(prompt) * BUILTIN_CONFIG.hidden_size * 4
    assert builtin.forward_stage([], 7, 10, hidden) == whole


@pytest.mark.parametrize(
    "tokens,start,end,hidden,message",
    [
        ([1], 3, 2, None, "not within"),
        ([1], 0, 11, None, "not within"),
        ([1], -1, 2, None, "not within"),
        ([], 0, 2, None, "neither tokens nor a hidden state"),
        ([], 2, 4, b"", "not a whole number"),
        ([], 2, 4, b"\0" * 1020, "not a whole number"),
        ([1], 2, 4, None, "needs the previous stage's hidden state"),
        ([32000], 0, 2, None, "must lie in"),
        ([1] * 2049, 0, 2, None, "exceeds the context window"),
    ],
)
def test_stage_rejects_what_it_cannot_run(builtin, tokens, start, end, hidden, message):
    with pytest.raises(StageError, match=message):
        builtin.forward_stage(tokens, start, end, hidden)


def test_stage_forwards_alongside_generations_leave_them_intact(builtin):
    prompts = [[i, i + 1, i + 2] for i in range(10, 14)]
    expected = [greedy(builtin, p, 24) for p in prompts]
    stage_token = builtin.forward_stage(prompts[0], 0, 10, None)
    results: list = [None] * 4
    stages: list = []

    def gen(i):
        results[i] = greedy(builtin, prompts[i], 24)

    threads = [threading.Thread(target=gen, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        stages.append(builtin.forward_stage(prompts[0], 0, 10, None))
    for thread in threads:
        thread.join()
    assert results == expected
    assert stages and all(s == stage_token for s in stages)


def test_dtype_flag_picks_the_weights_precision():
    from nodeagent import cli

    assert cli.parse_args(["--model", "builtin"]).dtype == "auto"
    assert cli.parse_args(["--model", "builtin", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(cli.UsageError, match="--dtype takes auto or float32 or bfloat16 or float16"):
        cli.parse_args(["--model", "builtin", "--dtype", "float64"])
    daemon = open_engine("torch", "builtin", device="cpu", max_batch=1, kv_budget_mb=8, dtype="bfloat16")
    try:
        assert daemon.model.dtype == torch.bfloat16
        assert "(builtin, llama, cpu bf16)" in daemon.summary() and "weights 34 MB" in daemon.summary()
        assert len(greedy(daemon, [1, 2, 3], 4)) == 4
    finally:
        daemon.close()


@given(torch_threads=st.integers(1, 512), cpus=st.integers(1, 1024))
def test_serving_threads_are_torchs_default_within_the_cpus_allowed(torch_threads, cpus):
    n = serving_threads(torch_threads, cpus)
    assert 1 <= n <= torch_threads, "at least one thread, never more than torch would run"
    assert n <= cpus, "no more threads than CPUs this process may use"
    assert n == min(torch_threads, cpus)


def test_only_the_scheduler_thread_runs_the_forward_on_several_threads_unless_the_operator_says_otherwise():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(os.cpu_count() or 1)
        want = serving_threads(torch.get_num_threads(), len(os.sched_getaffinity(0)))
        assert scheduler_threads("cpu", env={}) == want
        assert torch.get_num_threads() == 1, "the calling thread keeps one thread"
        torch.set_num_threads(os.cpu_count() or 1)
        for env in ({"OMP_NUM_THREADS": "3"}, {"MKL_NUM_THREADS": "3"}):
            assert scheduler_threads("cpu", env=env) is None
            assert torch.get_num_threads() == (os.cpu_count() or 1), f"{env} is the operator's choice"
        with pytest.raises(ModelLoadError, match="unknown device"):
            scheduler_threads("tpu", env={})
    finally:
        torch.set_num_threads(before)


def test_the_scheduler_thread_takes_its_own_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    model = builtin_model(torch.float32, CPU)
    seen = []
    logits = model.logits
    model.logits = lambda x, greedy=False: seen.append(torch.get_num_threads()) or logits(x, greedy)
    daemon = TorchDaemon(model, "builtin", max_batch=1, kv_blocks=64, threads=1)
    try:
        assert len(greedy(daemon, [1, 2, 3], 2)) == 2
        assert seen and set(seen) == {1}, "the forward ran on the scheduler's count, not the caller's 3"
        assert "1 CPU thread," in daemon.summary()
    finally:
        daemon.close()
        torch.set_num_threads(before)


def test_a_process_that_exits_with_an_engine_open_exits_cleanly():
    """The engine is closed at exit: its scheduler thread torn down by the interpreter's exit
    aborted the process."""
    script = (
        "from nodeagent.engine.torch_engine import TorchDaemon\n"
        "TorchDaemon.load('builtin', device='cpu', kv_budget_mb=8)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
