"""systemd's notify protocol: READY=1 once serving, WATCHDOG=1 while the engine makes progress,
STOPPING=1 at the drain, so a `Type=notify` unit with `WatchdogSec=` restarts a stalled node.

One datagram to the socket systemd names in NOTIFY_SOCKET; without it (no systemd, or a unit
of another type) every call does nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

READY = "READY=1"
WATCHDOG = "WATCHDOG=1"
STOPPING = "STOPPING=1"


def notify(state: str, env: Mapping[str, str] = os.environ) -> bool:
    """Tells systemd `state`; whether there was a systemd to tell."""
    path = env.get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path.startswith("@"):  # an abstract socket
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(path)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True
