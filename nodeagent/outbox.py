"""The bounded hand-off from a generation's worker to its connection's loop (the Rust node's mpsc
channel, with a bound).

The worker puts one batch per engine step and blocks while the outbox's slots are full, so a
loop that falls behind (a head that does not read or does not acknowledge) holds the generation
back instead of letting its tokens pile up in memory. An engine may ask `behind()` before a step
and give its lane to another generation while this one cannot move. An engine's own thread,
which must never block, `post`s its batches past the bound instead.

A hand-over sets the connection's waker, so the loop sleeps in poll(2) until there is something
to send, with one exception that keeps a fast stream from waking its loop every step: within
the stream interval after the loop last took tokens, small batches wait for the loop's next
look (`look_within`), which its sleep never passes. Each wake-up of a loop is time taken from
an engine that fills the machine's cores, so a stream of one-token steps goes out a few tokens
a frame, at most an interval late. The first tokens, those after a pause, a batch that fills a
quarter of the outbox and the end go at once. Intervals end on ticks of the clock that every
outbox shares, so the loops of many streams wake together.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from linkf.waker import Waker
from nodeagent.daemon import DaemonError, GenerationResult

#: Slots of the outbox: the worker waits while the batches it handed over and the loop has not
#: taken fill them. A batch takes a slot for each `SLOT_TOKENS` tokens it carries, at least
#: one, so at most 4,096 tokens wait here whatever the batch size: 64 of the torch engine's
#: one-token steps, or 4 of the mock's 1,024-token batches.
OUTBOX_SLOTS = 64
SLOT_TOKENS = 64
#: The stream interval unless the node is told otherwise (`--stream-interval-ms`): 25 looks a
#: second, where the Rust node held tokens until 16 had gathered or 200 ms had passed.
STREAM_INTERVAL_S = 0.040
#: Slots filled past which a hand-over wakes the loop whatever the interval: a producer that
#: makes big batches is bound by the loop's pace, not by its wake-ups.
_WAKE_FILL = OUTBOX_SLOTS // 4
#: How often a worker blocked on a full outbox looks at its cancel flag.
_CANCEL_CHECK = 0.05


def _slots(item: list[int] | Done) -> int:
    return max(1, -(-len(item) // SLOT_TOKENS)) if isinstance(item, list) else 1


class _Batches(queue.Queue):
    """A `queue.Queue` bounded in slots (`_slots` of each item, not one an item) that can also
    wait for room without putting anything, and take an engine's `post` past its bound."""

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self._filled = 0

    def _qsize(self) -> int:
        return self._filled

    def _put(self, item: list[int] | Done) -> None:
        self.queue.append(item)
        self._filled += _slots(item)

    def _get(self) -> list[int] | Done:
        item = self.queue.popleft()
        self._filled -= _slots(item)
        return item

    def wait_not_full(self, timeout: float) -> bool:
        with self.not_full:
            if self._qsize() >= self.maxsize:
                self.not_full.wait(timeout)
            return self._qsize() < self.maxsize

    def put_past_bound(self, item: list[int]) -> None:
        with self.not_empty:
            self._put(item)
            self.unfinished_tasks += 1
            self.not_empty.notify()


@dataclass(frozen=True)
class Done:
    """The generation ended: its result, or the daemon's error; None when the worker failed
    without one (the Rust node's hung-up channel)."""

    generated: GenerationResult | DaemonError | None


class Outbox:
    """One generation's batches on their way to the loop, then its `Done`."""

    def __init__(
        self,
        waker: Waker,
        cancel: threading.Event,
        capacity: int = OUTBOX_SLOTS,
        interval: float = STREAM_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`interval`: the stream interval in seconds; 0 wakes the loop at every hand-over."""
        self._queue = _Batches(maxsize=capacity)
        self._waker = waker
        self._cancel = cancel
        self._interval = interval
        self._clock = clock
        #: When (by `clock`, in s) the interval since the loop last took tokens ends. `_wake`
        #: and `interval_left` read this one value, so that at its very edge they cannot both
        #: leave a batch to the other.
        self._look_by = -math.inf
        #: The loop's side: what `take` pulled beyond its limit, sent first next time.
        self._carry: list[int] = []
        self._released = threading.Event()

    # The worker's side

    def put(self, batch: list[int]) -> bool:
        """Hands `batch` over, waiting while the outbox is full; False once the generation is
        cancelled, which hands nothing over."""
        return self._hand_over(list(batch), self._cancel)

    def finish(self, generated: GenerationResult | DaemonError | None) -> None:
        """Hands over the end, after every batch; dropped once the loop has let go."""
        self._hand_over(Done(generated), self._released)

    def post(self, batch: list[int]) -> bool:
        """Hands `batch` over at once, full or not (an engine's own thread must never block
        here; it looks at `behind` before each step instead); False once cancelled."""
        if self._cancel.is_set():
            return False
        self._queue.put_past_bound(batch)
        self._wake()
        return True

    def behind(self) -> bool:
        """The loop has not taken what was handed over: the next `put` would wait."""
        return self._queue.full()

    def wait_room(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for the loop to take something; True once it has."""
        return self._queue.wait_not_full(timeout)

    def _hand_over(self, item: list[int] | Done, give_up: threading.Event) -> bool:
        while not give_up.is_set():
            try:
                self._queue.put(item, timeout=_CANCEL_CHECK)
            except queue.Full:
                continue
            if isinstance(item, Done):
                self._waker.set()
            else:
                self._wake()
            return True
        return False

    def _wake(self) -> None:
        """Sets the waker after a batch, unless the loop looks again within the interval anyway
        and the outbox is not filling."""
        if self._clock() >= self._look_by or self._queue.qsize() >= _WAKE_FILL:
            self._waker.set()

    # The loop's side

    def take(self, limit: int) -> tuple[list[int], Done | None]:
        """Up to `limit` tokens handed over so far, oldest first, and the `Done` once every
        token before it has been taken."""
        tokens, self._carry = self._carry, []
        while len(tokens) < limit:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Done):
                return tokens, item
            tokens += item
        if len(tokens) > limit:
            tokens, self._carry = tokens[:limit], tokens[limit:]
        if tokens:
            self._look_by = self._interval_end(self._clock())
        return tokens, None

    def look_within(self) -> float | None:
        """Seconds until the loop must look here again: 0 while something waits to be taken,
        else until the end of the interval, within which a batch may come without a wake; None
        when the next batch will wake it."""
        left = self.interval_left()  # before `ready`: see `_wake`
        if self.ready():
            return 0.0
        return left

    def interval_left(self) -> float | None:
        """Seconds until the interval since the loop last took tokens ends (the head's frames
        wait that long for the pass that takes the next ones); None once it is over."""
        left = self._look_by - self._clock()
        return left if left > 0 else None

    def _interval_end(self, took_at: float) -> float:
        """The first multiple of the interval on the clock after `took_at`. Every outbox ends
        its intervals on the same ticks, so the loops of many streams wake in one burst an
        interval, not one after another all through it."""
        if self._interval <= 0:
            return took_at
        return (math.floor(took_at / self._interval) + 1) * self._interval

    def ready(self) -> bool:
        """Something waits to be taken."""
        return bool(self._carry) or not self._queue.empty()

    def release(self) -> None:
        """The loop lets the generation go (after setting its cancel): empties the outbox, so a
        worker blocked on a full one returns at once, and drops whatever it hands over next."""
        self._released.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
