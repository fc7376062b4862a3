"""The soak rows of `make reliability`: days of a fleet's use compressed into minutes. Eight
heads run generations back to back on one node: a quarter cancelled after their first tokens,
every 20th one's link dropped without a word and reconciled over a new one, each session
revoked when its generation ends. Between them, a share of the heads' turns are stage forwards
of a prompt, whole or split at a random layer, and one in ten of those is abandoned: its link
is dropped before the answer. Every token is checked against a reference; the node's
resident memory is sampled throughout, and its floor over the last quarter of the run must be
within `GROWTH_BOUND` of its floor over the second quarter (docs/hardening.md).

`python tests/reliability/soak.py {mock|torch|torch-int4} SECONDS` runs one soak and prints its
curve.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":
    HERE = Path(__file__).resolve().parent
    sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]

from harness import SETTLE_S, Row, WatchedNode, settle, table

from conformance.head import FleetHead, Generation
from conformance.reference import MOCK_LAYERS, mock_stage, mock_tokens
from proto import finish

HEADS = 8
#: Every this many generations a head drops its link mid-generation and reconciles.
DROP_EVERY = 20
CANCEL_SHARE = 0.25
#: The share of turns that are stage forwards rather than generations, and the share of those
#: whose link drops before the answer.
STAGE_SHARE, ABANDON_SHARE = 0.15, 0.1
#: How far the node's RSS floor may grow from the second quarter of a soak to the last.
GROWTH_BOUND = 4 * 2**20
#: At most this long between two samples of the node's RSS and threads.
SAMPLE_S = 3.0
#: How long a head waits for one generation before it counts it missing.
GENERATION_TIMEOUT = 60.0

MOCK_ARGS = ("--listen", "127.0.0.1:0", "--engine", "mock")
#: A KV pool of about 100 blocks against eight lanes of up to 15 blocks: preemption and the
#: prefix cache both run.
TORCH_ARGS = ("--listen", "127.0.0.1:0", "--model", "builtin", "--kv-budget-mb", "16", "--max-context", "512")
#: The same on int4 weights: the node's CPU kernels and their layer stack, where they run.
TORCH_INT4_ARGS = (*TORCH_ARGS, "--weights", "int4")
#: The torch soak's prompts: a prefix of 2 to 8 whole blocks shared with other prompts, then a
#: suffix of its own; max_new tokens up to 96.
PREFIX_BLOCKS = (2, 4, 6, 8)
SUFFIXES = 8
MAX_NEW = (8, 96)

#: Expected tokens and finish reason of a prompt's generation of up to max_new tokens.
Expect = Callable[[list[int], int], tuple[list[int], int]]


@dataclass
class Sample:
    at: float
    rss: int
    threads: int
    generations: int


@dataclass
class Tally:
    """What the heads did, counted under one lock."""

    generations: int = 0
    tokens: int = 0
    cancelled: int = 0
    dropped: int = 0
    stages: int = 0
    abandoned: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, tokens: int, cancelled: bool = False, dropped: bool = False) -> None:
        with self.lock:
            self.generations += 1
            self.tokens += tokens
            self.cancelled += cancelled
            self.dropped += dropped

    def add_stage(self, abandoned: bool) -> None:
        with self.lock:
            self.stages += 1
            self.abandoned += abandoned


# ---- references -------------------------------------------------------------------------------


def mock_expect(prompt: list[int], max_new: int) -> tuple[list[int], int]:
    return mock_tokens(prompt, max_new), finish.LENGTH


def mock_stage_token(prompt: list[int]) -> int:
    token = mock_stage(prompt, 0, MOCK_LAYERS)
    assert isinstance(token, int)
    return token


def random_prompts(rng: random.Random) -> list[int]:
    return [rng.randrange(32000) for _ in range(rng.randint(1, 40))]


class TorchReference:
    """The builtin model's greedy tokens for each soak prompt, and the token its stage forward
    over every layer answers, computed once, one lane at a time, by a `TorchDaemon` of this
    process: independent of the node's batching, preemption and prefix cache. A stage token is
    the generation's first token (docs/engines.md): computing the references checks that."""

    def __init__(self, rng: random.Random, weights: str = "auto") -> None:
        prefixes = [[rng.randrange(3, 32000) for _ in range(16 * n)] for n in PREFIX_BLOCKS]
        suffixes = [[rng.randrange(3, 32000) for _ in range(rng.randint(1, 24))] for _ in range(SUFFIXES)]
        self.prompts = [p + s for p in prefixes for s in suffixes]
        self._answers: dict[tuple[int, ...], tuple[list[int], int]] = {}
        self._stage_tokens: dict[tuple[int, ...], int] = {}
        self.n_layers = self._compute(weights)

    def _compute(self, weights: str) -> int:
        from nodeagent.daemon import GenExtras, StageToken
        from nodeagent.engine.torch_engine import TorchDaemon
        from proto.params import GenParams

        daemon = TorchDaemon.load("builtin", device="cpu", max_batch=1, threads=1, weights=weights)
        try:
            n_layers = daemon.model.config.n_layers
            for prompt in self.prompts:
                got = daemon.generate_tokens_streaming(prompt, GenParams(), MAX_NEW[1], 0, GenExtras(), lambda _: True)
                stage = daemon.forward_stage(prompt, 0, n_layers, None)
                assert isinstance(stage, StageToken) and got.tokens[:1] in ([], [stage.token]), (got.tokens, stage)
                self._answers[tuple(prompt)] = (list(got.tokens), got.finish)
                self._stage_tokens[tuple(prompt)] = stage.token
            return n_layers
        finally:
            daemon.close()

    def pick(self, rng: random.Random) -> list[int]:
        return rng.choice(self.prompts)

    def expect(self, prompt: list[int], max_new: int) -> tuple[list[int], int]:
        tokens, reason = self._answers[tuple(prompt)]
        if len(tokens) >= max_new:
            return tokens[:max_new], finish.LENGTH
        return tokens, reason

    def stage_token(self, prompt: list[int]) -> int:
        return self._stage_tokens[tuple(prompt)]


# ---- the heads --------------------------------------------------------------------------------


@dataclass
class Load:
    """What the heads send and expect back, and when they stop."""

    prompt: Callable[[random.Random], list[int]]
    expect: Expect
    #: The token a stage forward of a prompt over all `n_layers` answers.
    stage_token: Callable[[list[int]], int]
    n_layers: int
    stop: threading.Event = field(default_factory=threading.Event)


class SoakHead:
    """One head thread: generations back to back until `stop`, each on a session of its own."""

    def __init__(self, index: int, node: WatchedNode, row: Row, tally: Tally, load: Load) -> None:
        self.index, self.node, self.row, self.tally, self.load = index, node, row, tally, load
        self.rng = random.Random(1000 + index)
        self.thread = threading.Thread(target=self._run, name=f"soak-head-{index}", daemon=True)

    def _run(self) -> None:
        head = FleetHead.connect(self.node.addr)
        try:
            for n in range(1, sys.maxsize):
                if self.load.stop.is_set():
                    return
                try:
                    if self.rng.random() < STAGE_SHARE:
                        self._stage(head)
                    else:
                        self._one(head, (self.index << 40) | n, n)
                except Exception as e:  # noqa: BLE001 - a generation or stage forward the head could not finish
                    self.row.lost += 1
                    self.row.note(f"head {self.index}: {type(e).__name__}: {e}")
                    head.close()
                    head = FleetHead.connect(self.node.addr)
        finally:
            head.close()

    def _one(self, head: FleetHead, sid: int, n: int) -> None:
        prompt = self.load.prompt(self.rng)
        max_new = self.rng.randint(*MAX_NEW)
        expected, reason = self.load.expect(prompt, max_new)
        head.assign(sid)
        head.append(sid, prompt)
        req = head.request(sid, max_new)
        key = (sid, req.generation_id)
        if n % DROP_EVERY == 0:
            self._first_tokens(head, key)
            head.reconnect()
            self._check_prefix(head.generations[key], expected)
            self.tally.add(len(head.generations[key].tokens), dropped=True)
        elif self.rng.random() < CANCEL_SHARE:
            self._first_tokens(head, key)
            head.cancel(req)
            g = head.collect(req, GENERATION_TIMEOUT)
            self._check_prefix(g, expected)
            if g.finish not in (finish.CANCELLED, reason):
                self.row.wrong += 1
                self.row.note(f"a cancelled generation ended {g.finish}")
            self.tally.add(len(g.tokens), cancelled=True)
        else:
            g = head.collect(req, GENERATION_TIMEOUT)
            if (g.tokens, g.finish) != (expected, reason):
                self._check_prefix(g, expected)
                self.row.lost += len(g.tokens) < len(expected)
                self.row.note(f"{len(g.tokens)} tokens ending {g.finish}, wanted {len(expected)} ending {reason}")
            self.tally.add(len(g.tokens))
        head.revoke(sid)

    def _stage(self, head: FleetHead) -> None:
        """A stage forward of a prompt over every layer, split at a random layer into two
        requests or not; or one abandoned: its link dropped before the answer."""
        prompt, layers = self.load.prompt(self.rng), self.load.n_layers
        if self.rng.random() < ABANDON_SHARE:
            head.send_stage(prompt, 0, layers)
            head.reconnect()
            self.tally.add_stage(abandoned=True)
            return
        split = self.rng.randint(0, layers)
        if split in (0, layers):
            answer = head.stage(prompt, 0, layers, timeout=GENERATION_TIMEOUT)
        else:
            hidden = head.stage(prompt, 0, split, timeout=GENERATION_TIMEOUT).hidden
            answer = head.stage([], split, layers, hidden, timeout=GENERATION_TIMEOUT)
        if answer.token != self.load.stage_token(prompt):
            self.row.wrong += 1
            self.row.note(f"a stage forward split at layer {split} answered {answer.token}")
        self.tally.add_stage(abandoned=False)

    @staticmethod
    def _first_tokens(head: FleetHead, key: tuple[int, int]) -> None:
        head.until(lambda: head.generations.get(key), GENERATION_TIMEOUT, "the first tokens")

    def _check_prefix(self, g: Generation, expected: list[int]) -> None:
        if g.tokens != expected[: len(g.tokens)]:
            self.row.wrong += 1
            self.row.note(f"session {g.session_id}: tokens differ from the reference")


# ---- the rows ---------------------------------------------------------------------------------


def soak_mock(seconds: float) -> Row:
    """The soak against the mock engine (random prompts, the conformance kit's mock tokens)."""
    return soak("soak, mock", MOCK_ARGS, mock_load(), seconds)[0]


def soak_torch(seconds: float) -> Row:
    """The soak against the builtin torch model with a small KV pool."""
    return soak("soak, torch builtin", TORCH_ARGS, torch_load(), seconds)[0]


def soak_torch_int4(seconds: float) -> Row:
    """The torch soak on int4 weights: one lane at a time in this process must give the node's
    tokens under batching, preemption and the prefix cache, as the kernels' exact sums promise."""
    return soak("soak, torch builtin int4", TORCH_INT4_ARGS, torch_load("int4"), seconds)[0]


def mock_load() -> Load:
    return Load(random_prompts, mock_expect, mock_stage_token, MOCK_LAYERS)


def torch_load(weights: str = "auto") -> Load:
    reference = TorchReference(random.Random(34), weights)
    return Load(reference.pick, reference.expect, reference.stage_token, reference.n_layers)


def soak(name: str, args: tuple[str, ...], load: Load, seconds: float) -> tuple[Row, list[Sample]]:
    """Runs `HEADS` soak heads for `seconds` against a node started with `args`; the row and
    the RSS curve. The row's RSS column reads start→middle→end of the load, the end sampled
    before the heads stop."""
    row = Row(name, "", 0)
    node = WatchedNode(*args)
    tally = Tally()
    try:
        warm_up_node(node, load)
        time.sleep(SETTLE_S)  # the warm-up's connection thread ends
        threads = node.threads()
        heads = [SoakHead(i, node, row, tally, load) for i in range(HEADS)]
        start = time.monotonic()
        for head in heads:
            head.thread.start()
        samples = _sampled(node, tally, start, seconds)
        load.stop.set()
        for head in heads:
            head.thread.join(GENERATION_TIMEOUT + 10)
        row.seconds = time.monotonic() - start
        settle(node, threads)
        _fill(row, node, tally, samples, threads)
    finally:
        node.close()
    return row, samples


def warm_up_node(node: WatchedNode, load: Load) -> None:
    """One generation and one stage forward of the soak's kind, so first-use allocations (and
    the stage thread's OpenMP team) come before the start."""
    with FleetHead.connect(node.addr) as head:
        prompt = load.prompt(random.Random(0))
        head.assign(1)
        head.append(1, prompt)
        assert head.generate(1, 8, timeout=GENERATION_TIMEOUT).tokens == load.expect(prompt, 8)[0]
        head.revoke(1)
        assert head.stage(prompt, 0, load.n_layers, timeout=GENERATION_TIMEOUT).token == load.stage_token(prompt)


def floor_rss(samples: list[Sample], quarter: int) -> int:
    """The lowest RSS sampled in the run's second (`quarter` 1) or last (3) quarter, first
    sample excluded. Work in flight when a sample is taken (a stage forward's rows, a prefill's)
    only adds to it, so a floor moves with what the node keeps, not with what it was doing."""
    n = len(samples) - 1
    return min(s.rss for s in samples[1 + quarter * n // 4 : 1 + (quarter + 1) * n // 4] or samples[-1:])


def _sampled(node: WatchedNode, tally: Tally, start: float, seconds: float) -> list[Sample]:
    """RSS and threads every `SAMPLE_S` (or a tenth of the run, when shorter) until `seconds`."""
    every = min(SAMPLE_S, seconds / 10)
    samples = []
    for k in range(int(seconds / every) + 1):
        time.sleep(max(start + k * every - time.monotonic(), 0))
        samples.append(Sample(time.monotonic() - start, node.rss(), node.threads(), tally.generations))
    return samples


def _fill(row: Row, node: WatchedNode, tally: Tally, samples: list[Sample], threads: int) -> None:
    row.baseline_rss = samples[0].rss
    row.middle_rss, row.after_rss = floor_rss(samples, 1), floor_rss(samples, 3)
    row.slack = GROWTH_BOUND
    row.peak_rss = node.status("VmHWM")
    row.faults = tally.cancelled + tally.dropped + tally.abandoned
    after = node.threads()
    row.load = (
        f"{HEADS} heads, {tally.generations} gens, {tally.tokens} tokens, "
        f"{tally.cancelled} cancelled, {tally.dropped} dropped, {tally.stages} stages "
        f"({tally.abandoned} abandoned); threads {threads}→{after}"
    )
    if after > threads:
        row.wrong += 1
        row.note(f"{after - threads} threads left after the load")
    row.crashes += node.crashes()


def main(argv: list[str]) -> int:
    kind, seconds = argv[0], float(argv[1])
    args, make_load = {
        "torch": (TORCH_ARGS, torch_load),
        "torch-int4": (TORCH_INT4_ARGS, lambda: torch_load("int4")),
    }.get(kind, (MOCK_ARGS, mock_load))
    load = make_load()
    row, samples = soak(f"soak, {kind}", args, load, seconds)
    for s in samples:
        print(f"{s.at:7.1f} s  {s.rss / 2**20:7.1f} MB  {s.threads:3d} threads  {s.generations:8d} gens")
    print(table([row]))
    return 0 if row.clean() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
