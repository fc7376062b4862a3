"""The mock engine, token-exact with the Rust fleet's mock (spec: mock-engine.md).

A Rust head compares a fleet generation token for token with its own mock, so every value here
depends only on (context, counter) and never on batching, timing or concurrency.
"""

from __future__ import annotations

import itertools
import struct
import threading
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from nodeagent.daemon import (
    QOS_CLASSES,
    Consumer,
    Daemon,
    GenerationError,
    GenerationResult,
    GenExtras,
    OnTokens,
    SchedStats,
    StageError,
    StageHidden,
    StageOutput,
    StageToken,
    check_stream,
)
from proto import finish
from proto.params import GenParams

VOCAB = 32000
N_LAYERS = 24
PAGE_TOKENS = 16
BYTES_PER_TOKEN = 64
POOL_BYTES = 1 << 20
POOL_BLOCKS = POOL_BYTES // (PAGE_TOKENS * BYTES_PER_TOKEN)
#: The mock's context window unless told otherwise, as the Rust mock's.
MOCK_WINDOW = 4096
#: Tokens one `on_tokens` call carries when steps are not delayed: one call per step would
#: cost more than the step itself. As many as one TOKEN_EVENTS carries (`EVENT_TOKENS_MAX`),
#: so each hand-over to the loop is a frame (faster than 64-token batches on 1 and 8
#: connections: docs/performance.md); a batch still takes well under a cancel's 50 ms.
DEFAULT_BATCH_TOKENS = 1024

_U64 = (1 << 64) - 1
_LE64 = struct.Struct("<Q")
_LE32 = struct.Struct("<I")
#: How often a generation waiting on its consumer looks at its cancel flag and deadline.
_CONSUMER_CHECK = 0.05


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as 4-byte little-endian, oldest first; a value outside u32 is a ValueError."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as e:
        raise ValueError(f"a token does not fit in u32: {e}") from None


class _Stepper:
    """Next tokens of one generation: step k hashes the whole context then LE64(base + k).

    The context bytes live in a streaming XXH3 state that grows by four bytes a token, and each
    step hashes a copy of it plus the counter: the same value as hashing the full bytes anew,
    without re-reading the context.
    """

    def __init__(self, stream: Sequence[int], seed: int):
        self._ctx = xxhash.xxh3_64(pack_tokens(stream))
        self._counter = (seed + len(stream)) & _U64

    def take(self, n: int) -> list[int]:
        """The next `n` tokens. The hashing's calls are most of what a mock stream costs the
        node, so the loop binds what it calls once rather than calling per token, and counts with a
        range rather than adding and masking."""
        ctx = self._ctx
        copy, extend = ctx.copy, ctx.update
        pack_counter, pack_token = _LE64.pack, _LE32.pack
        tokens: list[int] = []
        append = tokens.append
        for counter in _counters(self._counter, n):
            step = copy()
            step.update(pack_counter(counter))
            token = step.intdigest() % VOCAB
            extend(pack_token(token))
            append(token)
        self._counter = (self._counter + n) & _U64
        return tokens


def _counters(start: int, n: int) -> Iterable[int]:
    """The `n` counter values from `start`, wrapping past the largest u64 to 0 as Rust's
    `wrapping_add` does."""
    end = start + n
    if end <= _U64 + 1:
        return range(start, end)
    return itertools.chain(range(start, _U64 + 1), range(end - _U64 - 1))


class _Lanes:
    """Lanes, queues and KV pages shared by every generation; all counters under one lock."""

    def __init__(self, max_lanes: int):
        self.max_lanes = max(1, max_lanes)
        self._cond = threading.Condition()
        self._pages: dict[int, int] = {}  # lane id -> pages resident
        self._queued = [0] * QOS_CLASSES
        self._decoded = 0
        self._prefilled = 0
        self._next_lane = 1

    def admit(self, qos: int, context_len: int, prefill: int, deadline: float | None, stops: tuple):
        """A lane id once one is free, holding `context_len` tokens of which `prefill` count as
        prefilled; None when the deadline passes or one of the `stops` events (the engine
        closing, the caller cancelling; None for none) is set first."""
        qos = min(max(qos, 0), QOS_CLASSES - 1)

        def stopped() -> bool:
            return any(e is not None and e.is_set() for e in stops)

        with self._cond:
            self._queued[qos] += 1
            try:
                while len(self._pages) >= self.max_lanes and not stopped():
                    wait = None if deadline is None else deadline - time.monotonic()
                    if wait is not None and wait <= 0:
                        return None
                    self._cond.wait(0.05 if wait is None else min(wait, 0.05))
                if stopped():
                    return None
            finally:
                self._queued[qos] -= 1
            lane = self._next_lane
            self._next_lane += 1
            self._pages[lane] = _pages(context_len)
            self._prefilled += prefill
            return lane

    def contended(self) -> bool:
        """Some generation waits for a lane."""
        with self._cond:
            return any(self._queued)

    def decoded(self, lane: int, tokens: int, context_len: int) -> None:
        with self._cond:
            self._decoded += tokens
            self._pages[lane] = _pages(context_len)

    def release(self, lane: int) -> None:
        with self._cond:
            del self._pages[lane]
            self._cond.notify()

    def stats(self) -> SchedStats:
        """The counters now; pages past the pool's 1024 read as a full pool, never more."""
        with self._cond:
            return SchedStats(
                decode_tokens=self._decoded,
                prefill_tokens=self._prefilled,
                queue_depth=tuple(self._queued),
                lanes_active=len(self._pages),
                pool_blocks_used=min(sum(self._pages.values()), POOL_BLOCKS),
                pool_blocks_total=POOL_BLOCKS,
            )


@dataclass
class _Run:
    """One generation's progress, kept across the lanes it runs on."""

    stepper: _Stepper
    prompt_len: int
    max_tokens: int
    deadline: float | None
    extras: GenExtras
    #: 4 bytes a token: as a list of ints, a 1M-token stream kept 36 MB until it ended (eight
    #: at once took the node from 36 to 331 MB).
    tokens: array = field(default_factory=lambda: array("I"))

    def context_len(self) -> int:
        return self.prompt_len + len(self.tokens)

    def ended(self, reason: int, unkept: Sequence[int] = ()) -> GenerationResult:
        """The result of a run that ended with `reason`: its tokens, then `unkept`, in the
        run's own array (the run is over, so nothing writes to it again)."""
        self.tokens.extend(unkept)
        return GenerationResult(self.tokens, reason)


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE_TOKENS)


class MockDaemon(Daemon):
    """The deterministic engine `--engine mock` serves from: no model, no end token.

    `token_delay_s` holds each step that long (tests use it to keep a generation open);
    `batch_tokens` is how many tokens each `on_tokens` call carries at most, which changes no
    value: by default `DEFAULT_BATCH_TOKENS`, or 1 when steps are delayed, so a delayed token
    is never held back. A generation whose consumer is behind gives its lane to the next one
    waiting, and queues for a lane again once the consumer catches up: a head that stops
    reading holds no lane.
    """

    def __init__(
        self,
        max_context: int = MOCK_WINDOW,
        max_lanes: int = 8,
        token_delay_s: float = 0.0,
        batch_tokens: int | None = None,
    ):
        self._max_context = max_context
        self._lanes = _Lanes(max_lanes)
        self._delay = token_delay_s
        if batch_tokens is None:
            batch_tokens = 1 if token_delay_s else DEFAULT_BATCH_TOKENS
        self._batch = max(1, batch_tokens)
        self._closed = threading.Event()

    @property
    def model_name(self) -> str:
        return "mock"

    def summary(self) -> str:
        return (
            f"runtime mock, context window {self._max_context} tokens, "
            f"{self._lanes.max_lanes} lanes"
        )

    def max_stream_tokens(self) -> int:
        return self._max_context

    def sched_stats(self) -> SchedStats:
        return self._lanes.stats()

    def close(self) -> None:
        self._closed.set()

    def generate_tokens_streaming(
        self,
        stream: Sequence[int],
        params: GenParams,
        max_tokens: int,
        deadline_ms: int,
        extras: GenExtras,
        on_tokens: OnTokens,
    ) -> GenerationResult:
        check_stream(stream, self._max_context)
        if max_tokens <= 0:
            return GenerationResult([], finish.NONE)
        deadline = time.monotonic() + deadline_ms / 1000 if deadline_ms else None
        try:
            stepper = _Stepper(stream, params.seed)
        except ValueError as e:
            raise GenerationError(str(e)) from None
        run = _Run(stepper, len(stream), max_tokens, deadline, extras)
        while True:
            prefill = 0 if run.tokens else len(stream)
            stops = (self._closed, extras.cancel)
            lane = self._lanes.admit(extras.qos_class, run.context_len(), prefill, deadline, stops)
            if lane is None:
                return self._unadmitted(run)
            try:
                result = self._run(lane, run, on_tokens)
            finally:
                self._lanes.release(lane)
            if result is not None:
                return result
            if extras.consumer is not None and not self._wait_for_consumer(run, extras.consumer):
                return self._unadmitted(run)

    def _unadmitted(self, run: _Run) -> GenerationResult:
        if self._closed.is_set() or run.extras.cancelled():
            return run.ended(finish.CANCELLED)
        return GenerationResult([], finish.NONE, expired=True)

    def _run(self, lane: int, run: _Run, on_tokens: OnTokens) -> GenerationResult | None:
        """Steps `run` on `lane` until it ends (its result), or its consumer is behind while
        another generation waits for a lane (None: the lane goes to that one, and the run waits
        for its consumer holding none)."""
        consumer = run.extras.consumer
        while len(run.tokens) < run.max_tokens:
            while consumer is not None and consumer.behind():
                if self._lanes.contended():
                    return None
                if not self._wait_room(run, consumer):
                    return self._unadmitted(run)
            batch = self._step(run, min(self._batch, run.max_tokens - len(run.tokens)))
            if isinstance(batch, GenerationResult):
                return batch
            run.tokens.extend(batch)
            self._lanes.decoded(lane, len(batch), run.context_len())
            if not on_tokens(batch):
                return run.ended(finish.CANCELLED)
        return run.ended(finish.NONE)

    def _step(self, run: _Run, n: int) -> list[int] | GenerationResult:
        """The next `n` tokens of `run`, or how it ended first: the engine closing (its delay
        waited out before each token), or the deadline. Without a delay the checks are made once
        a batch: a batch takes microseconds."""
        if not self._delay:
            if self._closed.is_set():
                return run.ended(finish.CANCELLED)
            if run.deadline is not None and time.monotonic() >= run.deadline:
                return GenerationResult([], finish.NONE, expired=True)
            return run.stepper.take(n)
        batch: list[int] = []
        for _ in range(n):
            if self._pause():
                return run.ended(finish.CANCELLED, batch)
            if run.deadline is not None and time.monotonic() >= run.deadline:
                return GenerationResult([], finish.NONE, expired=True)
            batch += run.stepper.take(1)
        return batch

    def _wait_for_consumer(self, run: _Run, consumer: Consumer) -> bool:
        """Waits, holding no lane, until `run`'s consumer can take more; False when the engine
        closes, the generation is cancelled or its deadline passes first."""
        while consumer.behind():
            if not self._wait_room(run, consumer):
                return False
        return True

    def _wait_room(self, run: _Run, consumer: Consumer) -> bool:
        """Waits a little for `run`'s consumer; False once the engine closes, the generation is
        cancelled or its deadline passes."""
        consumer.wait_room(_CONSUMER_CHECK)
        if self._closed.is_set() or run.extras.cancelled():
            return False
        return run.deadline is None or time.monotonic() < run.deadline

    def _pause(self) -> bool:
        """Waits out the per-token delay; True once the engine is closed."""
        return self._closed.wait(self._delay)

    def forward_stage(
        self, tokens: Sequence[int], start_layer: int, end_layer: int, hidden_in: bytes | None
    ) -> StageOutput:
        if start_layer > end_layer or end_layer > N_LAYERS:
            raise StageError(
                f"layers [{start_layer}, {end_layer}) are not a range of the mock's {N_LAYERS}"
            )
        h = _stage_input(tokens, hidden_in)
        for layer in range(start_layer, end_layer):
            h = xxhash.xxh3_64_intdigest(struct.pack("<QI", h, layer))
        if end_layer >= N_LAYERS:
            return StageToken(h % VOCAB)
        return StageHidden(struct.pack("<Q", h))


def _stage_input(tokens: Sequence[int], hidden_in: bytes | None) -> int:
    """The value a stage starts from: the previous stage's 8 bytes, else the tokens' hash."""
    if hidden_in is None:
        try:
            return xxhash.xxh3_64_intdigest(pack_tokens(tokens))
        except ValueError as e:
            raise StageError(str(e)) from None
    if len(hidden_in) != 8:
        raise StageError(f"a mock hidden state is 8 bytes, not {len(hidden_in)}")
    return int.from_bytes(hidden_in, "little")
