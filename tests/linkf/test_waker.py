"""The waker a connection's loop polls beside its socket: readable exactly while set, and no
hand-over lost however the workers' `set` and the loop's `clear` interleave."""

from __future__ import annotations

import os
import queue
import select
import threading
import time

import pytest

from linkf import gil_held
from linkf.waker import Waker


@pytest.fixture(params=["eventfd", "pipe"])
def waker(request, monkeypatch):
    if request.param == "pipe":
        monkeypatch.delattr(os, "eventfd", raising=False)
    elif not hasattr(os, "eventfd"):
        pytest.skip("no eventfd on this platform")
    w = Waker()
    yield w
    w.close()


def readable(w: Waker, timeout_ms: int = 0) -> bool:
    p = select.poll()
    p.register(w, select.POLLIN)
    return bool(p.poll(timeout_ms))


def test_readable_exactly_while_set(waker):
    assert not readable(waker)
    waker.set()
    waker.set()
    assert readable(waker)
    waker.clear()
    assert not readable(waker), "one clear drains however many sets came before it"
    waker.clear()
    assert not readable(waker)
    waker.set()
    assert readable(waker), "set again after a clear"


def test_set_after_close_is_harmless(waker):
    waker.close()
    waker.set()
    waker.clear()


def test_no_hand_over_is_lost_and_the_flag_keeps_with_the_descriptor(waker, monkeypatch):
    """Rounds in which four workers each hand over an item and set the waker while the loop
    clears and drains; the writes are slowed to widen every race. Every item arrives, and at
    the end of each round one clear leaves the waker unreadable: a flag that disagreed with the
    descriptor would leave it readable for good (the loop spinning) or miss a wake."""
    write = gil_held.write

    def slow_write(fd: int, data: bytes) -> int:
        time.sleep(0)
        return write(fd, data)

    monkeypatch.setattr(gil_held, "write", slow_write)
    workers, rounds = 4, 300
    items: queue.Queue[int] = queue.Queue()
    start, done = threading.Barrier(workers + 1), threading.Barrier(workers + 1)

    def work(k: int) -> None:
        for r in range(rounds):
            start.wait()
            items.put(r * workers + k)
            waker.set()
            done.wait()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
    for t in threads:
        t.start()
    got: set[int] = set()
    for r in range(rounds):
        start.wait()
        while len(got) < (r + 1) * workers:
            assert readable(waker, 2_000), f"round {r}: the loop was never woken"
            waker.clear()
            while not items.empty():
                got.add(items.get_nowait())
        done.wait()
        waker.clear()
        assert not readable(waker), f"round {r}: readable after a clear with no worker running"
    for t in threads:
        t.join()
    assert got == set(range(rounds * workers))
