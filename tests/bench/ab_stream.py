"""Paired A/B of two node trees on `serve.py`'s mock streaming rows: one stream on 1 connection
and the same tokens on 8 together, for a change too small for one run to show (issue 8).

Starts one `superfluid-noded --runtime mock` from each tree (each imports its own packages, as
in `ab_decode.py`; the head here decodes with this tree's). Each trial streams on node A and on
node B, 1 and 8 connections each, in reverse order every other trial (`serve.in_turn`). Prints
per connection count the median rates and, for B against A, the median ratio and how many
trials B won; then each node's median 8-to-1 ratio. One trial swings with the machine's load,
so the default 20 trials (about 4 minutes) settle a difference of about 5 %.

Run: .venv/bin/python tests/bench/ab_stream.py TREE_A TREE_B [TRIALS]
(a tree: a checkout or `git archive REV | tar -x -C DIR`; TRIALS default 20)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_decode import started_in, trees_and_count  # noqa: E402
from serve import STREAM_TOKENS, in_turn, median_interval, start_node, streaming_rate  # noqa: E402

CONNECTIONS = (1, 8)


def main() -> int:
    trees, trials = trees_and_count(__doc__, 20)
    rates: dict[tuple[str, int], list[float]] = {(k, c): [] for k in "AB" for c in CONNECTIONS}
    with tempfile.TemporaryDirectory() as tmp:
        nodes = {}
        for k, tree in zip("AB", trees, strict=True):
            home = Path(tmp) / k
            home.mkdir()
            nodes[k] = started_in(tree, lambda home=home: start_node(home, "--runtime", "mock"))
        try:
            runs = [
                (rates[(k, c)], lambda addr=nodes[k].addr, c=c: streaming_rate("node", addr, c, STREAM_TOKENS // c))
                for k in "AB"
                for c in CONNECTIONS
            ]
            for t in range(trials):
                in_turn(t, *runs)
                print(f"... trial {t + 1} of {trials}", file=sys.stderr, flush=True)
        finally:
            for node in nodes.values():
                node.kill()
    report(rates, trees, trials)
    return 0


def report(rates: dict[tuple[str, int], list[float]], trees: list[Path], trials: int) -> None:
    print(f"\nmock streaming, {STREAM_TOKENS:,} tokens a trial, {trials} trials; A = {trees[0]}, B = {trees[1]}")
    for c in CONNECTIONS:
        a, b = rates[("A", c)], rates[("B", c)]
        b_over_a = [y / x for x, y in zip(a, b, strict=True)]
        print(
            f"  {c} connection{'s' * (c > 1)}: A {statistics.median(a):,.0f} tok/s,"
            f" B {statistics.median(b):,.0f} tok/s; B / A median {statistics.median(b_over_a):.3f}"
            f" ({_interval(b_over_a)}), B won {sum(r > 1 for r in b_over_a)} of {trials}"
        )
    for k in "AB":
        eight_to_one = [e / o for o, e in zip(rates[(k, 1)], rates[(k, 8)], strict=True)]
        median = statistics.median(eight_to_one)
        print(f"  node {k}: 8 connections / 1, median {median:.3f} ({_interval(eight_to_one)})")


def _interval(ratios: list[float]) -> str:
    low, high = median_interval(ratios)
    return f"95 % interval {low:.3f}-{high:.3f}"


if __name__ == "__main__":
    sys.exit(main())
