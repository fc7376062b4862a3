"""Keeping the C heap's resident pages close to what is in use.

glibc keeps what a process freed (a model load's source tensors, big frame buffers, finished
connections) in its arenas, so without `malloc_trim` the resident set stays at its peak long
after the load has gone. And it gives threads arenas of their own, up to eight a CPU: threads
that come and go (a stage forward's, a connection's) each leave pages behind in another arena.
Elsewhere (musl, macOS) there are no such calls and this does nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

#: The arenas glibc may give a torch node's threads (`bound_arenas`).
ARENAS = 4
_M_ARENA_MAX = -8


def _libc_function(name: str) -> Callable[..., int] | None:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_function("malloc_trim")
_MALLOPT = _libc_function("mallopt")


def return_free_memory() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def bound_arenas() -> None:
    """At most `ARENAS` malloc arenas from now on, unless the operator set MALLOC_ARENA_MAX
    (which glibc has read already). Arenas made before stay; so this runs before the engine
    starts its threads."""
    if _MALLOPT is not None and "MALLOC_ARENA_MAX" not in os.environ:
        _MALLOPT(_M_ARENA_MAX, ARENAS)
