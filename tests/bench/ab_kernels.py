"""Paired A/B of the node's CPU kernels at two commits, in one process, for a change to
`cpu_kernels.c` or its headers: SmolLM2's 120 projections (30 layers of qkv, o, gate/up and down,
distinct random weights, so nothing stays in cache) at several row counts, on OpenMP's team
(`OMP_NUM_THREADS`, else a thread per core).

Compiles the kernels' sources as each revision holds them, with the flags of the build this
processor runs (`SUPERFLUID_CPU_KERNELS` picks another, as for the node), and loads both libraries
side by side. Their outputs must be equal: every sum is exact, so a change of schedule moves no
bit. Then each round times A's 120 calls and B's, and the bench prints per row count both
medians, A over B and how many rounds B was faster in.

Run: .venv/bin/python tests/bench/ab_kernels.py REV_A REV_B [--bits 4|8] [--rows 1,8,128] [--rounds N]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nodeagent.engine import cpu_kernels as ck  # noqa: E402

#: SmolLM2-135M's projections as (outputs, inputs): qkv, o, gate/up, down.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def built_at(rev: str, build: ck.Build, into: Path) -> ck.CpuKernels:
    """The kernels as `rev` holds them, compiled with `build`'s flags into `into`."""
    for path in (ck.SOURCE, *ck.HEADERS):
        name = path.relative_to(ROOT).as_posix()
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{name}"], check=True,
                              capture_output=True).stdout
        (into / path.name).write_bytes(text)
    library = into / "kernels.so"
    subprocess.run([*ck.compile_command(build), "-o", str(library), str(into / ck.SOURCE.name)], check=True)
    loaded = ctypes.CDLL(str(library))
    return ck.CpuKernels(loaded, build, tiles=build.tiles and ck._tiles(loaded))


def projections(kernels: ck.CpuKernels, bits: int, seed: int = 0) -> list[tuple[ck.BoundWeight, int]]:
    """The same random weights every call (`seed`), bound to `kernels`: (weight, inputs)."""
    gen = torch.Generator().manual_seed(seed)
    bound = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            scales = (torch.rand(n, k // ck.GROUP, generator=gen) * 0.01).to(ck.SCALE_DTYPE)
            if bits == 4:
                codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
                minimums = (-torch.rand(n, k // ck.GROUP, generator=gen) * 0.05).to(ck.SCALE_DTYPE)
                bound.append((kernels.bound(4, kernels.pack_int4(codes), kernels.pack_scales(scales, minimums)), k))
            else:
                codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
                bound.append((kernels.bound(8, kernels.pack_int8(codes), kernels.pack_scales(scales)), k))
    return bound


def timed(weights: list[tuple[ck.BoundWeight, int]], rows: dict[int, torch.Tensor]) -> float:
    began = time.perf_counter()
    for weight, k in weights:
        weight(rows[k])
    return time.perf_counter() - began


def compare(a: list, b: list, count: int, rounds: int) -> str:
    rows = {k: torch.randn(count, k) for _, k in SHAPES}
    for (wa, k), (wb, _) in zip(a, b, strict=True):
        if not torch.equal(wa(rows[k]), wb(rows[k])):
            raise SystemExit(f"A and B give different outputs at {count} rows: a change of bits, not of pace")
    times_a, times_b = [], []
    for _ in range(rounds):
        times_a.append(timed(a, rows))
        times_b.append(timed(b, rows))
    ma, mb = statistics.median(times_a), statistics.median(times_b)
    won = sum(tb < ta for ta, tb in zip(times_a, times_b, strict=True))
    return f"{count:>5} rows: A {1e3 * ma:8.2f} ms, B {1e3 * mb:8.2f} ms, A/B {ma / mb:5.2f}x, B faster {won}/{rounds}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev_a")
    parser.add_argument("rev_b")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--rows", default="1,2,4,8,16,128")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    builds, reason = ck._builds_for_here()
    if not builds:
        raise SystemExit(f"no build of the kernels runs here: {reason}")
    with tempfile.TemporaryDirectory() as dir_a, tempfile.TemporaryDirectory() as dir_b:
        a = projections(built_at(args.rev_a, builds[0], Path(dir_a)), args.bits)
        b = projections(built_at(args.rev_b, builds[0], Path(dir_b)), args.bits)
        print(f"{builds[0].label} build, int{args.bits}, SmolLM2's {LAYERS * len(SHAPES)} projections, "
              f"A = {args.rev_a}, B = {args.rev_b}, medians of {args.rounds} alternating rounds")
        for count in map(int, args.rows.split(",")):
            print(compare(a, b, count, args.rounds), flush=True)


if __name__ == "__main__":
    main()
