"""systemd's notify protocol: the node says READY=1 once it serves, WATCHDOG=1 while its engine
makes progress and STOPPING=1 when it drains, to the datagram socket NOTIFY_SOCKET names."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from nodeagent.sdnotify import READY, notify

MOCK = ("--listen", "127.0.0.1:0", "--engine", "mock")


@pytest.fixture
def systemd(tmp_path):
    """A datagram socket standing in for systemd's; its path, and the socket to read."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    yield path, sock
    sock.close()


def messages_until(sock: socket.socket, wanted: str, timeout: float = 10) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        seen.append(sock.recv(256).decode())
    return seen


def test_a_state_reaches_the_socket_named_and_nothing_is_sent_without_one(systemd):
    path, sock = systemd
    assert notify(READY, {"NOTIFY_SOCKET": path})
    assert sock.recv(256) == b"READY=1"
    assert not notify(READY, {})
    assert not notify(READY, {"NOTIFY_SOCKET": path + ".gone"})


def test_an_abstract_socket_is_reached_by_its_at_sign_name():
    name = f"superfluid-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        assert notify("WATCHDOG=1", {"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(256) == b"WATCHDOG=1"


def test_the_node_says_ready_then_pings_the_watchdog_then_says_it_stops(noded, systemd):
    path, sock = systemd
    node = noded(*MOCK, NOTIFY_SOCKET=path)
    assert messages_until(sock, "WATCHDOG=1")[0] == "READY=1"
    node.proc.send_signal(signal.SIGTERM)
    assert "STOPPING=1" in messages_until(sock, "STOPPING=1")
    assert node.wait() == 0
