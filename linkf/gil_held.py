"""System calls that return at once, made without letting go of the GIL.

CPython lets go of the GIL around every socket and ``os`` call, whether it can block or not.
With many threads (a loop and a worker for each connection) every letting go hands the GIL to
a thread waiting for it, and the caller then waits to get it back: two context switches for a
send that took microseconds. Most of a streaming node's context switches followed such a
call (docs/performance.md, "Serve loop").

A call through ``ctypes.PyDLL`` keeps the GIL. These wrappers make only calls that cannot
wait: sends, receives and eventfd reads and writes on non-blocking descriptors, and sends short
enough (``HELD_SEND_MAX``) that the kernel's copy costs less than the switch; a larger send
lets go as before, so other threads run while the kernel copies. Each behaves as its socket or
``os`` twin: the same return values, the same ``OSError`` subclasses (``BlockingIOError`` when
nothing could move), for any bytes-like data. The twins stand in where libc cannot be called
this way (not POSIX), on a CPython without a GIL (nothing to keep), and where the operator set
``SUPERFLUID_GIL_HELD_CALLS=0``.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading
from collections.abc import Callable

#: The operator's switch: "0" makes every call its socket or ``os`` twin.
SWITCH = "SUPERFLUID_GIL_HELD_CALLS"

#: The largest send made holding the GIL: about what the kernel's copy of it costs against the
#: two switches it saves (docs/performance.md).
HELD_SEND_MAX = 64 * 1024
#: The largest receive made holding the GIL (a head's acknowledgements: a hundred of them); a
#: larger one lets go for what lies beyond, as a bulk transfer should.
HELD_RECV_MAX = 4 * 1024

_SEND_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)


def _libc() -> ctypes.PyDLL | None:
    """libc's send, recv, write and read, returning ssize_t. Their argument types are not
    declared, which spares a conversion call per argument: ctypes passes a Python int as a C
    int, bytes or a ctypes buffer as a pointer to its data, and each size goes as a
    `ctypes.c_size_t`, the type the call takes."""
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    if os.name != "posix" or not gil or os.environ.get(SWITCH) == "0":
        return None
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        calls = (libc.send, libc.recv, libc.write, libc.read)
    except (OSError, AttributeError):
        return None
    for call in calls:
        call.restype = ctypes.c_ssize_t
    return libc


_LIBC = _libc()
_SIZE = ctypes.c_size_t
#: Each thread's receive buffer, used again for every receive and read it makes.
_buffers = threading.local()


def held() -> bool:
    """Whether these calls keep the GIL here (False: they are their socket and ``os`` twins)."""
    return _LIBC is not None


def send(sock: socket.socket, data: bytes | bytearray | memoryview, start: int = 0) -> int:
    """Sends ``data[start:]`` as ``sock.send`` would (the socket is non-blocking): how many
    bytes the socket took."""
    view = memoryview(data).cast("B")[start:]
    if _LIBC is None or len(view) > HELD_SEND_MAX:
        return sock.send(view)
    held = data if start == 0 and type(data) is bytes else view.tobytes()
    taken = _LIBC.send(sock.fileno(), held, _SIZE(len(held)), _SEND_FLAGS)
    if taken < 0:
        raise _error()
    return taken


def recv(sock: socket.socket, size: int) -> bytes:
    """Receives up to ``size`` bytes as ``sock.recv`` would (the socket is non-blocking): b""
    once the peer has closed."""
    if _LIBC is None:
        return sock.recv(size)
    held_size = min(size, HELD_RECV_MAX)
    data = _into_buffer(_LIBC.recv, sock.fileno(), held_size, socket.MSG_DONTWAIT)
    if len(data) == held_size < size:
        try:
            data += sock.recv(size - held_size)
        except (BlockingIOError, InterruptedError):
            pass
    return data


def write(fd: int, data: bytes | bytearray | memoryview) -> int:
    """``os.write`` on a non-blocking descriptor."""
    if _LIBC is None:
        return os.write(fd, data)
    held = data if type(data) is bytes else memoryview(data).cast("B").tobytes()
    written = _LIBC.write(fd, held, _SIZE(len(held)))
    if written < 0:
        raise _error()
    return written


def read(fd: int, size: int) -> bytes:
    """``os.read`` on a non-blocking descriptor."""
    if _LIBC is None or size > HELD_RECV_MAX:
        return os.read(fd, size)
    return _into_buffer(_LIBC.read, fd, size)


def _into_buffer(call: Callable[..., int], fd: int, size: int, *flags: int) -> bytes:
    """What `call` (recv or read) puts into this thread's buffer, at most `size` bytes, up to
    `HELD_RECV_MAX`."""
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = ctypes.create_string_buffer(HELD_RECV_MAX)
    got = call(fd, buf, _SIZE(size), *flags)
    if got < 0:
        raise _error()
    return buf.raw[:got]


def _error() -> OSError:
    code = ctypes.get_errno()
    return OSError(code, os.strerror(code))
