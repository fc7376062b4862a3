"""The CPU attention kernel of a decode step against the bytes it must read, in one run.

A decode step attends each lane's one new row to every key and value its context holds, so past
a few hundred tokens of context a step's attention is bound by reading the KV pool. This times
one step's attention over SmolLM2-135M's 30 layers (9 query heads, 3 KV heads of 64) on the
node's CPU kernels, for 1 and 8 lanes at several context lengths, over an fp32 pool and an fp16
one (`--kv-dtype auto` where the kernels attend), with the pool's blocks handed out by `KVPool`
as the scheduler takes them. Each row prints the median step, the pool bytes it reads, and that
rate against this machine's stream bandwidth (a torch `sum` over 1 GB on the same threads: what
reading memory once costs here).

Target: at contexts of 2,048 tokens or more, attention reads at ≥ `TARGET` of the stream
bandwidth. Exits 1 when a row misses it, 2 where the node's CPU kernels do not run.

Run: .venv/bin/python tests/bench/attention.py [CONTEXT ...]  (default 128 512 2048 4096; about 1 minute)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nodeagent.engine.cpu_kernels import cpu_kernels  # noqa: E402
from nodeagent.engine.kvpool import BLOCK_TOKENS, KVPool, blocks_for  # noqa: E402
from nodeagent.engine.torch_engine import scheduler_threads  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
LANES = (1, 8)
STEPS = 15
TARGET = 0.4
#: From this context on a step is bound by the pool's bytes, and the target applies.
LONG = 2048


def stream_gb_s() -> float:
    """GB/s of a torch `sum` over 1 GB, the best of 5."""
    data = torch.ones(2**28)
    data.sum()
    best = min(_timed(data.sum) for _ in range(5))
    return data.numel() * 4 / best / 1e9


def _timed(run) -> float:
    began = time.perf_counter()
    run()
    return time.perf_counter() - began


def attention_step_s(context: int, lanes: int, dtype: torch.dtype) -> float:
    """Median seconds of one decode step's attention over every layer: each lane's row at
    position `context` attends to its `context` + 1 keys in a pool of `dtype`."""
    kernels = cpu_kernels()
    per_lane = blocks_for(context + 1)
    pool = KVPool(LAYERS, KV_HEADS, HEAD_DIM, lanes * per_lane, dtype, torch.device("cpu"))
    tables = [pool.allocate(per_lane) for _ in range(lanes)]
    pool.kv.normal_()
    blocks = torch.tensor(tables)
    slots = blocks[:, context // BLOCK_TOKENS] * BLOCK_TOKENS + context % BLOCK_TOKENS
    step = kernels.attention_step(slots, blocks, torch.full((lanes,), context), torch.ones(lanes, dtype=torch.long), 0)
    q, kv = torch.randn(lanes, 1, HEADS, HEAD_DIM), torch.randn(lanes, 1, 2, KV_HEADS, HEAD_DIM)

    def one_step() -> None:
        for layer in range(LAYERS):
            step(pool.kv[layer], q, kv)

    one_step()
    return statistics.median(_timed(one_step) for _ in range(STEPS))


def main() -> int:
    if cpu_kernels() is None:
        print("attention.py: the node's CPU kernels do not run here")
        return 2
    torch.set_num_threads(scheduler_threads("cpu"))
    contexts = [int(a) for a in sys.argv[1:]] or [128, 512, 2048, 4096]
    bandwidth = stream_gb_s()
    print(f"decode-step attention on the node's CPU kernels ({cpu_kernels().name}), {torch.get_num_threads()}"
          f" threads; stream bandwidth {bandwidth:.1f} GB/s")
    print(f"  {'pool':>5} {'context':>7} {'lanes':>5} {'step':>9} {'KV read':>9} {'rate':>10} {'of stream':>9}"
          "  target")
    missed = []
    for dtype in (torch.float32, torch.float16):
        name = f"fp{dtype.itemsize * 8}"
        for context in contexts:
            for lanes in LANES:
                took = attention_step_s(context, lanes, dtype)
                read = lanes * (context + 1) * LAYERS * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
                share = read / took / 1e9 / bandwidth
                target = f"≥ {TARGET} {'ok' if share >= TARGET else 'MISSED'}" if context >= LONG else "-"
                if context >= LONG and share < TARGET:
                    missed.append(f"{name}, {context} tokens, {lanes} lanes")
                print(f"  {name:>5} {context:7d} {lanes:5d} {took * 1e3:7.2f}ms {read / 1e6:7.1f}MB"
                      f" {read / took / 1e9:6.1f}GB/s {share:9.2f}  {target}")
    for m in missed:
        print(f"MISSED: {m}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
