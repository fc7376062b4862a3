"""`linkf.gil_held`: each call behaves as its socket or `os` twin (the same bytes, the same errors),
and the short ones keep the GIL, which their twins let go of."""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linkf import gil_held


@pytest.fixture(params=["held", "twins"])
def calls(request, monkeypatch):
    """`gil_held` as it runs here, and as it runs where libc cannot be called (the twins)."""
    if request.param == "held" and not gil_held.held():
        pytest.skip("libc cannot be called holding the GIL here")
    if request.param == "twins":
        monkeypatch.setattr(gil_held, "_LIBC", None)
    return gil_held


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


@pytest.fixture
def pair():
    a, b = _pair()
    yield a, b
    a.close()
    b.close()


def _drain(calls, sock: socket.socket, size: int) -> bytes:
    got = b""
    while True:
        try:
            chunk = calls.recv(sock, size)
        except BlockingIOError:
            return got
        assert chunk, "the peer is still open"
        got += chunk


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frames=st.lists(st.integers(0, 3 * gil_held.HELD_SEND_MAX), max_size=6),
    read_size=st.sampled_from([1_000, gil_held.HELD_RECV_MAX, 64 * 1024]),
)
def test_frames_arrive_whole_and_in_order_through_full_buffers(calls, frames, read_size):
    """Frames of every size around the held limits, written until the socket takes no more
    (BlockingIOError, as the twin) and read back in reads of every size around them."""
    a, b = _pair()
    try:
        sent = b"".join(bytes([i % 251]) * n for i, n in enumerate(frames))
        got = b""
        for i, n in enumerate(frames):
            data, start = bytes([i % 251]) * n, 0
            while start < len(data):
                try:
                    start += calls.send(a, data, start)
                except BlockingIOError:
                    got += _drain(calls, b, read_size)
        got += _drain(calls, b, read_size)
        assert got == sent
    finally:
        a.close()
        b.close()


def test_a_read_larger_than_the_held_limit_takes_what_lies_beyond_it(calls, pair):
    a, b = pair
    data = os.urandom(3 * gil_held.HELD_RECV_MAX)
    a.sendall(data)
    assert calls.recv(b, len(data)) == data


def test_a_read_larger_than_the_held_limit_reads_as_its_twin(calls):
    r, w = os.pipe()
    try:
        os.set_blocking(r, False)
        data = os.urandom(3 * gil_held.HELD_RECV_MAX)
        os.write(w, data)
        assert calls.read(r, len(data)) == data
    finally:
        os.close(r)
        os.close(w)


def test_threads_receiving_at_once_each_get_their_own_bytes(calls):
    """Each thread receives into a buffer of its own: with the GIL changing hands as often as
    it can, no thread's bytes show up in another's receive."""
    failures: list[str] = []

    def receive(tag: int) -> None:
        a, b = _pair()
        try:
            for i in range(2_000):
                data = bytes([tag]) * (1 + i % 300)
                calls.send(a, data)
                got = calls.recv(b, 1024)
                if got != data:
                    failures.append(f"thread {tag}: {got[:8]!r}... for {data[:8]!r}...")
                    return
        finally:
            a.close()
            b.close()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=receive, args=(tag,)) for tag in range(1, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []


def test_nothing_to_read_is_blocking_io_and_a_closed_peer_is_empty(calls, pair):
    a, b = pair
    with pytest.raises(BlockingIOError):
        calls.recv(b, 100)
    a.close()
    assert calls.recv(b, 100) == b""


def test_sending_to_a_closed_peer_is_the_twins_error(calls, pair):
    a, b = pair
    b.close()
    with pytest.raises(OSError) as raised:
        calls.send(a, b"x")
    assert raised.value.errno in (errno.EPIPE, errno.ECONNRESET)
    assert type(raised.value) in (BrokenPipeError, ConnectionResetError)


def test_a_closed_socket_is_a_bad_descriptor(calls, pair):
    a, _ = pair
    a.close()
    with pytest.raises(OSError) as raised:
        calls.send(a, b"x")
    assert raised.value.errno == errno.EBADF


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="no eventfd on this platform")
def test_an_eventfd_counts_writes_and_reads_empty_as_blocking_io(calls):
    fd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        with pytest.raises(BlockingIOError):
            calls.read(fd, 8)
        assert calls.write(fd, (2).to_bytes(8, "little")) == 8
        assert calls.write(fd, (3).to_bytes(8, "little")) == 8
        assert int.from_bytes(calls.read(fd, 8), "little") == 5
        with pytest.raises(BlockingIOError):
            calls.read(fd, 8)
    finally:
        os.close(fd)


def _turns_taken_by_another_thread(call, times: int) -> int:
    """How many times a thread that wants the GIL gets it while this one makes `call`
    `times` times: only when this one lets go of it, with the switch interval far away."""
    turns = 0
    stop = threading.Event()
    ready = threading.Event()

    def other() -> None:
        nonlocal turns
        ready.set()
        while not stop.is_set():
            turns += 1
            os.sched_yield()  # lets go of the GIL: the caller's turn again

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    thread = threading.Thread(target=other)
    try:
        thread.start()
        ready.wait()
        before = turns
        for _ in range(times):
            call()
        during = turns - before
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()
    return during


@pytest.mark.skipif(not gil_held.held(), reason="libc cannot be called holding the GIL here")
def test_short_calls_keep_the_gil_that_their_twins_let_go_of(pair):
    a, b = pair
    frame = b"f" * 200

    def held_round() -> None:
        gil_held.send(a, frame)
        gil_held.recv(b, 1024)

    def twin_round() -> None:
        a.send(frame)
        b.recv(1024)

    # A let-go call hands the GIL over only when the waiting thread wakes before the caller takes
    # it back, which a short run may never see: hence many rounds.
    assert _turns_taken_by_another_thread(twin_round, 20_000) > 0, "the twins let go of the GIL"
    assert _turns_taken_by_another_thread(held_round, 20_000) == 0


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview, lambda b: memoryview(b).cast("I")])
def test_any_bytes_like_object_is_sent_as_its_bytes(calls, pair, kind):
    a, b = pair
    data = os.urandom(64)
    assert calls.send(a, kind(data)) == 64
    assert calls.send(a, kind(data), 8) == 56
    assert b.recv(1000) == data + data[8:]
    r, w = os.pipe()
    try:
        assert calls.write(w, kind(data)) == 64
        assert os.read(r, 100) == data
    finally:
        os.close(r)
        os.close(w)


def test_the_operators_switch_turns_the_held_calls_off():
    import subprocess

    code = "from linkf import gil_held; print(gil_held.held())"
    for value, want in (("0", "False"), ("1", str(gil_held.held()))):
        env = {**os.environ, gil_held.SWITCH: value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == want, out.stderr
