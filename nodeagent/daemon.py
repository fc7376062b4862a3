"""What the node agent needs of the engine behind it (node-behaviour.md §2).

The agent talks to the mock and the torch engine only through `Daemon`, so either can stand
behind it unchanged.
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from proto.params import GenParams

#: `on_tokens(batch)` returns True to go on, False to stop the generation (finish CANCELLED).
OnTokens = Callable[[list[int]], bool]

QOS_CLASSES = 4  # 0 chat, 1 completion, 2 agent, 3 background
#: The smallest context window a node serves (`--max-context` and the torch engine's floor).
MIN_CONTEXT = 512


class DaemonError(Exception):
    """A failure of the engine behind the agent."""


class ModelLoadError(DaemonError):
    """The model could not be loaded; the CLI exits 3 on it."""


class StreamTooLong(DaemonError):
    """The stream does not fit the model's context window: the head should not have sent it."""

    def __init__(self, max_tokens: int, stream_len: int):
        self.max_tokens = max_tokens
        self.stream_len = stream_len
        super().__init__(
            f"this model's maximum context length is {max_tokens} tokens, but your request has "
            f"{stream_len} tokens; shorten the prompt or drop earlier turns"
        )


class ConstraintError(DaemonError):
    """The generation asks for a constraint this engine cannot apply."""


class GenerationError(DaemonError):
    """The generation failed for a reason of the node's own."""


class EngineFault(GenerationError):
    """The engine failed the generation (a step raised, stalled or ran out of memory, or the
    scheduler died): the head gets Finish(ERROR) and may retry elsewhere."""


class StageError(DaemonError):
    """A stage forward was asked for with inputs that cannot be run."""


def check_stream(stream: Sequence[int], max_context: int) -> None:
    """The checks every engine makes before generating from `stream`: content, and the window."""
    if not stream:
        raise GenerationError("session has no content to generate from")
    if len(stream) > max_context:
        raise StreamTooLong(max_context, len(stream))


class Consumer(Protocol):
    """Where a generation's tokens go, seen from the engine: a consumer that is `behind` would
    block the next `on_tokens`, so an engine may give the generation's lane to another until
    `wait_room` says it can move again.

    An engine that batches on a thread of its own may hand each batch to `post` from that
    thread instead of passing it back to the caller's thread for `on_tokens`: one thread wake
    less per token, which is what lets the wire keep up with a batched decode. `post` never
    blocks, so such an engine looks at `behind` before producing more; every batch must be
    posted, in order, before the call returns."""

    def behind(self) -> bool: ...

    def wait_room(self, timeout: float) -> bool: ...

    def post(self, batch: list[int]) -> bool:
        """Takes `batch` without waiting, even past the bound; False once the generation is
        cancelled, which takes nothing."""
        ...


@dataclass(frozen=True)
class GenExtras:
    """What a generation may carry beyond its stream and params."""

    qos_class: int = 0
    #: Set by the caller to stop the generation even before its first token: one still waiting
    #: for a lane leaves its queue at once (finish CANCELLED) rather than when a lane frees.
    cancel: threading.Event | None = None
    #: The consumer of the tokens, when it can say that it is behind (None: never behind).
    consumer: Consumer | None = None

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


@dataclass(frozen=True)
class GenerationResult:
    """`tokens` generated, the engine's `finish` reason, and whether the wall budget ran out.

    `tokens` is any sequence: the mock hands back its own 4-byte-a-token array, since a list of
    a long stream would take nine times the memory and a long hold of the GIL to build, all for
    a length."""

    tokens: Sequence[int]
    finish: int
    expired: bool = False


@dataclass(frozen=True)
class StageHidden:
    """A stage that stops before the last layer: the hidden state, little-endian bytes."""

    data: bytes


@dataclass(frozen=True)
class StageToken:
    """A stage that reaches the last layer: the greedy next token."""

    token: int


StageOutput = StageHidden | StageToken


@dataclass(frozen=True)
class SchedStats:
    """A snapshot of the scheduler's counters; `decode_tokens`, `prefill_tokens`, and the
    decode steps' count and seconds only grow."""

    decode_tokens: int = 0
    prefill_tokens: int = 0
    #: Batched decode steps, and the wall time they took: their ratio is the step time, the
    #: engine's pace, which shows what else on the machine takes from it (an engine without
    #: batched steps, the mock, leaves both 0).
    decode_steps: int = 0
    decode_seconds: float = 0.0
    #: Of `decode_seconds`, the time in the model's forward; the rest is choosing the tokens
    #: and handing them on (to the head itself, when the engine sends them), which shows what
    #: serving a step costs beside computing it.
    decode_forward_seconds: float = 0.0
    queue_depth: tuple[int, ...] = field(default=(0,) * QOS_CLASSES)
    lanes_active: int = 0
    pool_blocks_used: int = 0
    pool_blocks_total: int = 0


class EngineHealth(StrEnum):
    """Whether the engine makes progress: `/health` and `/ready` answer 503 unless OK."""

    OK = "ok"
    #: A step has run past the stall timeout; it may still return.
    STALLED = "engine stalled"
    #: The scheduler thread died; the node exits.
    FAILED = "engine failed"


@dataclass(frozen=True)
class DeviceMemory:
    """The accelerator's memory in bytes, for the capacity a head places by; 0 = none or
    unknown."""

    total: int = 0
    free: int = 0


def host_memory_bytes() -> int:
    """The machine's physical memory in bytes (0 when the OS will not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class Daemon(abc.ABC):
    """The engine interface. Every method may be called from any thread."""

    @abc.abstractmethod
    def generate_tokens_streaming(
        self,
        stream: Sequence[int],
        params: GenParams,
        max_tokens: int,
        deadline_ms: int,
        extras: GenExtras,
        on_tokens: OnTokens,
    ) -> GenerationResult:
        """Generate up to `max_tokens` after `stream`, handing each batch to `on_tokens` (or
        to `extras.consumer.post`: see `Consumer`).

        `deadline_ms` is a wall budget from the call (0 = none): past it the call returns
        `GenerationResult([], finish.NONE, expired=True)`. `on_tokens` returning False returns at
        once with finish CANCELLED. Raises StreamTooLong, or GenerationError for an empty stream.
        """

    @abc.abstractmethod
    def forward_stage(
        self, tokens: Sequence[int], start_layer: int, end_layer: int, hidden_in: bytes | None
    ) -> StageOutput:
        """Run layers `[start_layer, end_layer)`; raises StageError on inputs it cannot run."""

    @abc.abstractmethod
    def max_stream_tokens(self) -> int:
        """The context window in tokens (0 = unknown)."""

    @abc.abstractmethod
    def sched_stats(self) -> SchedStats:
        """The scheduler's counters now."""

    @property
    @abc.abstractmethod
    def model_name(self) -> str:
        """The name the head matches on, unless `--model-name` overrides it."""

    @abc.abstractmethod
    def summary(self) -> str:
        """One line for the start-up log: runtime, context window, lanes."""

    def device_memory(self) -> DeviceMemory:
        """The memory of the device the model runs on; none for an engine off any accelerator."""
        return DeviceMemory()

    def health(self) -> EngineHealth:
        """Whether the engine makes progress; an engine with no thread of its own always does."""
        return EngineHealth.OK

    def close(self) -> None:  # noqa: B027 - an engine with no threads has nothing to stop
        """Stop background threads; generations still running end CANCELLED."""
