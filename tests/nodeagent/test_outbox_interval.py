"""The outbox's stream interval: which hand-overs wake the connection's loop, and that a batch
handed over without a wake never waits past the loop's next look."""

from __future__ import annotations

import select
import threading

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from linkf.waker import Waker
from nodeagent.outbox import OUTBOX_SLOTS, Outbox

INTERVAL = 0.040


class Clock:
    """The outbox's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def is_set(waker: Waker) -> bool:
    return bool(select.select([waker], [], [], 0)[0])


def test_the_first_batch_wakes_the_loop_then_small_ones_wait_for_its_look():
    clock, waker = Clock(), Waker()
    out = Outbox(waker, threading.Event(), interval=INTERVAL, clock=clock)
    assert out.look_within() is None, "before any tokens the next batch wakes the loop"
    assert out.post([1]) and is_set(waker), "the first tokens go at once"
    waker.clear()
    assert out.take(10) == ([1], None)
    assert out.look_within() == pytest.approx(INTERVAL)
    clock.now += 0.010
    assert out.post([2]) and not is_set(waker), "a step's token within the interval waits"
    assert out.look_within() == 0.0, "what waits makes the loop look now"
    clock.now += 0.035
    assert out.take(10) == ([2], None)
    clock.now += 0.045
    assert out.look_within() is None, "after a pause the next batch wakes the loop again"
    assert out.post([3]) and is_set(waker)
    waker.close()


def test_the_intervals_of_every_outbox_end_on_the_same_ticks():
    """Loops that took their tokens at different moments look again at the same one, never
    more than an interval after their take."""
    clock = Clock()
    wakers = [Waker() for _ in range(3)]
    outs = [Outbox(w, threading.Event(), interval=INTERVAL, clock=clock) for w in wakers]
    ends = set()
    for i, out in enumerate(outs):
        clock.now = 100.0 + 0.013 * i + 0.002
        out.post([i])
        assert out.take(10) == ([i], None)
        left = out.look_within()
        assert left is not None and 0 < left <= INTERVAL
        ends.add(round(clock.now + left, 9))
        out.release()
    assert len(ends) == 1, f"the intervals end at {sorted(ends)}"
    for w in wakers:
        w.close()


def test_a_filling_outbox_and_the_end_wake_the_loop_whatever_the_interval():
    clock, waker = Clock(), Waker()
    out = Outbox(waker, threading.Event(), interval=INTERVAL, clock=clock)
    out.post([0])
    waker.clear()
    out.take(10)
    for i in range(OUTBOX_SLOTS // 4 - 1):
        assert out.put([i]) and not is_set(waker)
    assert out.put([99]) and is_set(waker), "a quarter-full outbox wakes the loop"
    waker.clear()
    out.take(10**6)
    out.finish(None)
    assert is_set(waker), "the end never waits"
    waker.close()


def test_an_interval_of_zero_wakes_the_loop_for_every_batch():
    clock, waker = Clock(), Waker()
    out = Outbox(waker, threading.Event(), interval=0.0, clock=clock)
    for token in range(5):
        assert out.post([token]) and is_set(waker)
        waker.clear()
        assert out.take(10) == ([token], None)
        assert out.look_within() is None
    waker.close()


class FakeWaker:
    """A waker that notes when it was set."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.set_at: float | None = None

    def set(self) -> None:
        if self.set_at is None:
            self.set_at = self.clock.now

    def clear(self) -> None:
        self.set_at = None


@settings(max_examples=300, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=0.1), min_size=1, max_size=60),
    sizes=st.lists(st.integers(min_value=1, max_value=80), min_size=60, max_size=60),
    interval=st.sampled_from([0.0, 0.005, 0.040, 0.2]),
)
@example(gaps=[0.0, 0.005], sizes=[1] * 60, interval=0.005)  # a batch at the interval's very edge
def test_no_token_waits_longer_than_the_interval_for_a_loop_that_sleeps_as_told(gaps, sizes, interval):
    """A loop that sleeps until its waker or `look_within` takes every batch within the
    interval of its hand-over, whatever the pace of the hand-overs."""
    clock = Clock()
    waker = FakeWaker(clock)
    out = Outbox(waker, threading.Event(), interval=interval, clock=clock)  # type: ignore[arg-type]
    handed: list[float] = []  # when each token was handed over, oldest first
    taken = 0
    look_at = float("inf")

    def loop_until(t: float) -> None:
        nonlocal taken, look_at
        while True:
            wake = min(look_at, waker.set_at if waker.set_at is not None else float("inf"))
            if wake > t or wake == float("inf"):
                return
            clock.now = wake
            waker.clear()
            tokens, _ = out.take(1 << 20)
            for handed_at in handed[taken : taken + len(tokens)]:
                assert clock.now - handed_at <= interval + 1e-5
            taken += len(tokens)
            look = out.look_within()
            # A float rounding may leave a look a hair away: the loop's poll rounds it up.
            look_at = float("inf") if look is None else clock.now + max(look, 1e-6)

    at = clock.now
    for gap, size in zip(gaps, sizes, strict=False):
        at += gap
        loop_until(at)
        clock.now = at
        out.post(list(range(size)))
        handed += [at] * size
    loop_until(float("inf"))
    assert taken == len(handed), "every token was taken"
