"""Stage forwards over Link F against the same node's own prefill, side by side in one run.

A head serving a model split across nodes sends each node a STAGE_FORWARD_REQ per token with
the whole stream (there is no KV cache between stage forwards), so a stage forward of N tokens
does the work of a prefill of N tokens, and that prefill on the same node is its yardstick.
Two `superfluid-noded` processes serve SmolLM2-135M-Instruct Q4_1 (the model `make run`
serves); a head in this process times, on fresh random prompts of each length:
- prefill: a one-token generation on node A (its time to the first token);
- one stage: layers [0, L) on node A, answered with the greedy token;
- two stages: layers [0, L/2) on node A, its hidden state (N x 576 fp32 on the wire) then
  layers [L/2, L) on node B: the per-token cost of a two-node pipeline.

Each row prints the medians over `ROUNDS` rounds (the three taken back to back in each) and
each stage's time over the prefill's. Targets: one stage ≤ `ONE_STAGE` × the prefill, two
stages ≤ `TWO_STAGES` × (the hidden state's bytes cross the wire twice). Every round also checks
that both stage paths answer the token the generation answered: on the node's CPU kernels the
three compute each position alike. Exits 1 when a target or a token is missed.

Run: .venv/bin/python tests/bench/stage.py [LENGTH ...]  (default 128 512 2048; about 3 minutes)
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nodeproc import Noded  # noqa: E402

from conformance.head import FleetHead  # noqa: E402
from proto.params import GenParams  # noqa: E402

MODEL = "smollm2-135m-instruct"
N_LAYERS = 30
LENGTHS = (128, 512, 2048)
ROUNDS = 5
ONE_STAGE, TWO_STAGES = 1.2, 1.35
VOCAB = range(100, 30000)


@dataclass
class Round:
    prefill: float
    one_stage: float
    two_stages: float
    tokens: tuple[int, int, int]


def timed_round(a: FleetHead, b: FleetHead, session_id: int, prompt: list[int]) -> Round:
    a.assign(session_id, GenParams())
    a.append(session_id, prompt)
    began = time.monotonic()
    generated = a.generate(session_id, 1).tokens[0]
    prefill = time.monotonic() - began
    a.revoke(session_id)
    began = time.monotonic()
    whole = a.stage(prompt, 0, N_LAYERS).token
    one_stage = time.monotonic() - began
    began = time.monotonic()
    hidden = a.stage(prompt, 0, N_LAYERS // 2).hidden
    split = b.stage([], N_LAYERS // 2, N_LAYERS, hidden).token
    two_stages = time.monotonic() - began
    return Round(prefill, one_stage, two_stages, (generated, whole, split))


def row(length: int, a: FleetHead, b: FleetHead, rng: random.Random) -> list[str]:
    rounds = [timed_round(a, b, 1000 * length + i, [rng.choice(VOCAB) for _ in range(length)])
              for i in range(ROUNDS)]
    prefill = statistics.median(r.prefill for r in rounds)
    one = statistics.median(r.one_stage for r in rounds)
    two = statistics.median(r.two_stages for r in rounds)
    print(f"| {length} | {prefill * 1e3:.1f} ms ({length / prefill:.0f} tok/s) | {one * 1e3:.1f} ms, "
          f"{one / prefill:.2f}x | {two * 1e3:.1f} ms, {two / prefill:.2f}x |")
    missed = [f"{length} tokens: a round's tokens (generation, one stage, two stages) {r.tokens} differ"
              for r in rounds if len(set(r.tokens)) != 1]
    if one > ONE_STAGE * prefill:
        missed.append(f"{length} tokens: one stage {one / prefill:.2f}x the prefill (target ≤ {ONE_STAGE}x)")
    if two > TWO_STAGES * prefill:
        missed.append(f"{length} tokens: two stages {two / prefill:.2f}x the prefill (target ≤ {TWO_STAGES}x)")
    return missed


def main() -> int:
    lengths = [int(arg) for arg in sys.argv[1:]] or list(LENGTHS)
    rng = random.Random(11)
    missed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        homes = [Path(tmp) / name for name in "ab"]
        for home in homes:
            home.mkdir()
        nodes = [Noded(["--listen", "127.0.0.1:0", "--model", MODEL, "--device", "cpu"], home) for home in homes]
        try:
            with FleetHead.connect(nodes[0].addr) as a, FleetHead.connect(nodes[1].addr) as b:
                print(f"SmolLM2-135M-Instruct, {N_LAYERS} layers, two nodes; medians of {ROUNDS} rounds")
                print("| prompt | prefill (node A) | one stage, A | two stages, A then B |")
                print("|---|---|---|---|")
                for length in lengths:
                    missed += row(length, a, b, rng)
        finally:
            for node in nodes:
                node.stop()
    for m in missed:
        print(f"MISSED: {m}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
