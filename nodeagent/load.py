"""The node's load as the head reads it in capacity: busy time, and decode and prefill rates.

Rates are measured over busy time only (time with at least one generation running): a rate
over wall time would make an idle node look slow. Each is an EWMA of the counters' growth,
sampled once busy time has advanced `MIN_BUSY_MS` (node-behaviour.md §1, "Capacity").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nodeagent.daemon import SchedStats

U32_MAX = 2**32 - 1
#: Busy time a rate sample needs before it counts.
MIN_BUSY_MS = 200


class Busy:
    """Time with at least one generation running; the caller guards it with its lock."""

    def __init__(self) -> None:
        self.running = 0
        self.since: float | None = None
        self.total = 0.0

    def start(self) -> None:
        if self.running == 0:
            self.since = time.monotonic()
        self.running += 1

    def stop(self) -> None:
        self.running = max(self.running - 1, 0)
        if self.running == 0 and self.since is not None:
            self.total += time.monotonic() - self.since
            self.since = None

    def ms(self) -> int:
        current = time.monotonic() - self.since if self.since is not None else 0.0
        return int((self.total + current) * 1000)


@dataclass(frozen=True)
class LoadSample:
    """What capacity reports of the scheduler and the rates, at `sampled_at_ms`."""

    kv_blocks_used: int
    kv_blocks_total: int
    lanes_active: int
    queue_depth: int
    decode_tokens_per_s: int
    prefill_tokens_per_s: int
    sampled_at_ms: int


@dataclass(frozen=True)
class _Counters:
    busy_ms: int
    decoded: int
    prefilled: int


@dataclass
class LoadMeter:
    """Busy time and the rates' EWMAs; the caller guards it with its lock."""

    busy: Busy = field(default_factory=Busy)
    decode_rate: int = 0
    prefill_rate: int = 0
    _last: _Counters | None = None

    def sample(self, stats: SchedStats, now_ms: int) -> LoadSample:
        """Folds `stats` into the rates when enough busy time has passed, and reports them."""
        now = _Counters(self.busy.ms(), stats.decode_tokens, stats.prefill_tokens)
        if self._last is None:
            self._last = now
        elif now.busy_ms - self._last.busy_ms >= MIN_BUSY_MS:
            dt_ms = now.busy_ms - self._last.busy_ms
            decode = _rate(now.decoded, self._last.decoded, dt_ms)
            prefill = _rate(now.prefilled, self._last.prefilled, dt_ms)
            if decode > 0:
                self.decode_rate = _smooth(self.decode_rate, decode)
            if prefill > 0:
                self.prefill_rate = _smooth(self.prefill_rate, prefill)
            self._last = now
        return LoadSample(
            kv_blocks_used=stats.pool_blocks_used,
            kv_blocks_total=stats.pool_blocks_total,
            lanes_active=stats.lanes_active & U32_MAX,
            queue_depth=sum(stats.queue_depth) & U32_MAX,
            decode_tokens_per_s=self.decode_rate,
            prefill_tokens_per_s=self.prefill_rate,
            sampled_at_ms=now_ms,
        )


def _rate(count: int, prev: int, dt_ms: int) -> int:
    return (max(count - prev, 0) * 1000 // dt_ms) & U32_MAX


def _smooth(prev: int, sample: int) -> int:
    """The EWMA of the node's rates: the first sample as is, then 3/4 the old plus 1/4 the new."""
    return sample if prev == 0 else (prev * 3 + sample) // 4
