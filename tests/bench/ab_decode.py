"""Paired A/B of two node trees on the 8-lane torch decode, for a change too small for one
`serve.py` run to show (issue 8).

Starts one `superfluid-noded --model builtin` from each tree (each imports its own `nodeagent`,
`linkf` and `proto`: it runs with that tree as its working directory) and loads the same model
in this process. Each round decodes `serve.DECODE_TOKENS` tokens on 8 lanes in process, on node
A and on node B, in an order that rotates through all six, and takes each one's mean decode
step (the scheduler's count, in process or from the node's /metrics). Prints the medians, and
for A against B the median step ratio and how many rounds B won. It prints each node's part of a
step beside the model's forward too (choosing the tokens and sending them), the part a change
to the send path moves, without the forward's own swing. On a 2-core machine a difference of a
couple of per cent needs several runs (docs/performance.md).

Run: .venv/bin/python tests/bench/ab_decode.py TREE_A TREE_B [ROUNDS]
(a tree: a checkout or `git archive REV | tar -x -C DIR`; ROUNDS default 30, 4-5 minutes)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import (  # noqa: E402  (it puts tests/ on the path, for nodeproc's Noded)
    DECODE_LANES,
    DECODE_TOKENS,
    Decode,
    Noded,
    decode_heads,
    local_decode_round,
    start_decode_node,
    wire_decode_round,
)

from conformance.head import FleetHead  # noqa: E402
from nodeagent.engine.torch_engine import TorchDaemon, scheduler_threads  # noqa: E402

ORDERS = ("LAB", "ABL", "BLA", "LBA", "BAL", "ALB")
T = TypeVar("T")


def started_in(tree: Path, start: Callable[[], T]) -> T:
    """What `start` returns, run with `tree` as the working directory: a node it starts with
    `python -m nodeagent` imports that tree's packages, the directory being first on its path."""
    here = os.getcwd()
    os.chdir(tree)
    try:
        return start()
    finally:
        os.chdir(here)


def trees_and_count(doc: str, default: int) -> tuple[list[Path], int]:
    """TREE_A TREE_B [COUNT] from the command line; exits with `doc`'s usage when they are not."""
    if len(sys.argv) not in (3, 4):
        sys.exit(doc.rsplit("Run: ", 1)[1])
    trees = [Path(a).resolve() for a in sys.argv[1:3]]
    for tree in trees:
        if not (tree / "nodeagent" / "__main__.py").is_file():
            sys.exit(f"{Path(sys.argv[0]).name}: {tree} holds no nodeagent/")
    return trees, int(sys.argv[3]) if len(sys.argv) == 4 else default


def node_from(tree: Path, home: Path) -> tuple[Noded, str, list[FleetHead]]:
    """A node run from `tree`, its metrics address and one placed head a lane."""
    node, metrics = started_in(tree, lambda: start_decode_node(home))
    return node, metrics, decode_heads(node.addr)


def main() -> int:
    trees, rounds = trees_and_count(__doc__, 30)
    results: dict[str, list[Decode]] = {"L": [], "A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        threads = scheduler_threads("cpu")  # the nodes' own thread count, as serve.py does
        daemon = TorchDaemon.load("builtin", device="cpu", max_batch=DECODE_LANES, threads=threads)
        nodes = [node_from(tree, Path(tmp)) for tree in trees]
        try:
            (_, metrics_a, heads_a), (_, metrics_b, heads_b) = nodes
            rounds_of = {
                "L": lambda: local_decode_round(daemon),
                "A": lambda: wire_decode_round(heads_a, metrics_a),
                "B": lambda: wire_decode_round(heads_b, metrics_b),
            }
            for r in range(rounds):
                for which in ORDERS[r % len(ORDERS)]:
                    results[which].append(rounds_of[which]())
                print(f"... round {r + 1} of {rounds}", file=sys.stderr, flush=True)
        finally:
            for node, _, _ in nodes:
                node.kill()
            daemon.close()
    report(results, trees, rounds)
    return 0


def report(results: dict[str, list[Decode]], trees: list[Path], rounds: int) -> None:
    steps = {k: [d.step_s for d in v] for k, v in results.items()}
    a_over_b = [a / b for a, b in zip(steps["A"], steps["B"], strict=True)]
    print(f"\n8-lane builtin decode, {rounds} rounds of {DECODE_TOKENS} tokens; A = {trees[0]}, B = {trees[1]}")
    for k, name in (("L", "in process"), ("A", "node A"), ("B", "node B")):
        print(f"  {name:<10} step median {statistics.median(steps[k]) * 1000:.2f} ms")
    for k in ("A", "B"):
        ratio = statistics.median(loc / s for loc, s in zip(steps["L"], steps[k], strict=True))
        print(f"  in process / node {k}: median {ratio:.3f}")
    print(
        f"  node A / node B step: median {statistics.median(a_over_b):.3f} (above 1: B faster);"
        f" B won {sum(r > 1 for r in a_over_b)} of {rounds} rounds"
    )
    beside = {k: [d.serving_s for d in results[k]] for k in ("A", "B")}
    print(
        f"  beside the forward: node A {statistics.median(beside['A']) * 1000:.3f} ms, node B"
        f" {statistics.median(beside['B']) * 1000:.3f} ms; B less in"
        f" {sum(a > b for a, b in zip(beside['A'], beside['B'], strict=True))} of {rounds} rounds"
    )


if __name__ == "__main__":
    sys.exit(main())
