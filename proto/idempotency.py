"""Idempotency helpers for Link F: pure logic, no I/O.

Commands are applied at most once (``CommandTable``), token events are committed at most once
and in order (``EventDedup``), the sender keeps what the receiver has not acknowledged
(``RetryBuffer``), and a lease is judged against a monotonic clock the caller passes in
(``LeaseClock``, milliseconds).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

R = TypeVar("R")
E = TypeVar("E")


class CommandTable(Generic[R]):
    """Results of the commands already applied, by command id, so a replay returns the first
    result instead of running again."""

    def __init__(self) -> None:
        self._applied: dict[int, R] = {}

    def apply(self, command_id: int, compute: Callable[[], R]) -> tuple[R, bool]:
        """``(result, fresh)``: ``compute`` runs only the first time ``command_id`` is seen."""
        if command_id in self._applied:
            return self._applied[command_id], False
        result = compute()
        self._applied[command_id] = result
        return result, True

    def get(self, command_id: int) -> R | None:
        return self._applied.get(command_id)

    def trim(self, watermark: int) -> None:
        """Forgets every command id at or below ``watermark``: the peer will not replay them."""
        self._applied = {k: v for k, v in self._applied.items() if k > watermark}

    def __len__(self) -> int:
        return len(self._applied)


@dataclass(frozen=True, order=True)
class GenerationKey:
    session_id: int
    epoch: int
    generation_id: int


class DedupOutcome(enum.Enum):
    Accepted = "accepted"
    AlreadyCommitted = "already committed"
    StaleEpoch = "stale epoch"


@dataclass(eq=True)
class Gap(Exception):
    """An event past the next expected one: committing it would leave a hole in the stream."""

    key: GenerationKey
    expected: int
    got: int

    def __str__(self) -> str:
        return f"gap in event_seq for {self.key}: expected {self.expected}, got {self.got}"


class EventDedup:
    """The next expected ``event_seq`` of every generation, and the current epoch of every
    session, so retransmissions commit nothing and superseded epochs commit nothing."""

    def __init__(self) -> None:
        self._next_seq: dict[GenerationKey, int] = {}
        self._session_epoch: dict[int, int] = {}

    def set_session_epoch(self, session_id: int, epoch: int) -> None:
        """Records ``epoch`` as current; a newer one drops the older epochs' generations."""
        prev = self._session_epoch.get(session_id)
        self._session_epoch[session_id] = epoch
        if prev is None or prev < epoch:
            self._next_seq = {
                k: n for k, n in self._next_seq.items() if k.session_id != session_id or k.epoch >= epoch
            }

    def retire_generation(self, key: GenerationKey) -> None:
        self._next_seq.pop(key, None)

    def retire_session(self, session_id: int) -> None:
        self._next_seq = {k: n for k, n in self._next_seq.items() if k.session_id != session_id}
        self._session_epoch.pop(session_id, None)

    def accept(self, key: GenerationKey, event_seq: int) -> DedupOutcome:
        """Judges one event; raises ``Gap`` when it skips ahead of the next expected seq."""
        current = self._session_epoch.get(key.session_id)
        if current is not None and key.epoch < current:
            return DedupOutcome.StaleEpoch
        expected = self._next_seq.get(key, 0)
        if event_seq < expected:
            return DedupOutcome.AlreadyCommitted
        if event_seq > expected:
            raise Gap(key, expected, event_seq)
        self._next_seq[key] = expected + 1
        return DedupOutcome.Accepted

    def watermark(self, key: GenerationKey) -> int | None:
        """The highest ``event_seq`` accepted for ``key``, None before the first."""
        n = self._next_seq.get(key, 0)
        return n - 1 if n > 0 else None

    def tracked_generations(self) -> int:
        return len(self._next_seq)


class RetryBuffer(Generic[E]):
    """Events sent but not yet acknowledged, in ``event_seq`` order."""

    def __init__(self) -> None:
        self._events: deque[tuple[int, E]] = deque()

    def push(self, event_seq: int, event: E) -> None:
        self._events.append((event_seq, event))

    def ack(self, watermark: int) -> list[E]:
        """Drops the leading events at or below ``watermark``, and returns them."""
        dropped = []
        while self._events and self._events[0][0] <= watermark:
            dropped.append(self._events.popleft()[1])
        return dropped

    def retransmit_from(self, from_seq: int) -> list[E]:
        return [e for seq, e in self._events if seq >= from_seq]

    def __len__(self) -> int:
        return len(self._events)


@dataclass(frozen=True)
class LeaseClock:
    """A lease received at ``received_at`` (ms on the caller's monotonic clock). A ``now``
    before the receipt counts as no time elapsed, never as expiry."""

    received_at: int
    duration_ms: int
    renew_by_ms: int

    def _elapsed(self, now: int) -> int:
        return max(now - self.received_at, 0)

    def renew_at(self) -> int:
        """When (ms) the holder should ask for a renewal."""
        return self.received_at + self.renew_by_ms

    def expires_at(self) -> int:
        return self.received_at + self.duration_ms

    def must_renew(self, now: int) -> bool:
        return self._elapsed(now) >= self.renew_by_ms

    def expired(self, now: int) -> bool:
        return self._elapsed(now) >= self.duration_ms
