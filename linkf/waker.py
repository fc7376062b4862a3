"""A file descriptor other threads make readable to wake a loop blocked in poll(2).

A connection's loop waits in one ``poll`` for the head's bytes, a worker's output and its next
deadline together: a worker calls ``set`` after handing something over, and the loop calls
``clear`` before it looks at what was handed over. ``set`` writes only when the waker is not
already set, so a worker handing over many batches makes one system call, not one each, and
``clear`` reads only when it is set, so a pass the head's bytes woke makes none. Both make
theirs through ``gil_held``, holding the GIL: a busy engine thread that let go of it would wait to
get it back.
"""

from __future__ import annotations

import os
import threading

from . import gil_held

_ONE = (1).to_bytes(8, "little")


class Waker:
    """An eventfd on Linux, else a pipe; non-blocking on both ends."""

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            self._read = self._write = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            self._read, self._write = os.pipe()
            os.set_blocking(self._read, False)
            os.set_blocking(self._write, False)
        self._set = False
        self._closed = False
        # A worker may outlive its connection: `set` and `close` take turns, so a late `set`
        # never writes into a descriptor number the process has handed to someone else; `set`
        # and `clear` take turns too, so the flag never disagrees with the descriptor.
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self._read

    def set(self) -> None:
        """Makes the waker readable. Called after the hand-over, so the loop that clears it
        next is sure to see what was handed over."""
        if self._set:  # the byte is written or being written: the next `clear` takes it
            return
        with self._lock:
            if self._set or self._closed:
                return
            self._set = True
            try:
                gil_held.write(self._write, _ONE)
            except OSError:
                pass

    def clear(self) -> None:
        """Drains the waker; call it before looking at what workers handed over. The flag and
        the byte change together under the lock, so the flag says whether there is a byte."""
        if not self._set:
            return
        with self._lock:
            if not self._set or self._closed:
                return
            self._set = False
            try:
                gil_held.read(self._read, 8)  # an eventfd's whole count, or a pipe's one byte
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._read)
            if self._write != self._read:
                os.close(self._write)
