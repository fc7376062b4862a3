"""Handing the C heap's free pages back to the system.

glibc keeps what a process freed (a model load's source tensors, big frame buffers, finished
connections) in its arenas, so without `malloc_trim` the resident set stays at its peak long
after the load has gone. Elsewhere (musl, macOS) there is no such call and this does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def return_free_memory() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
