"""`nodeagent.heap`: a torch node's threads share at most `ARENAS` malloc arenas."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

#: Threads that each malloc while the others hold theirs, so glibc would hand each an arena.
COUNT_ARENAS = textwrap.dedent("""
    import ctypes, os, re, sys, tempfile, threading
    from nodeagent import heap
    if sys.argv[1] == "bounded":
        heap.bound_arenas()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.fopen.restype = ctypes.c_void_p
    barrier = threading.Barrier(8)
    def allocate():
        block = libc.malloc(4096)
        barrier.wait()
        libc.free(ctypes.c_void_p(block))
    threads = [threading.Thread(target=allocate) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    path = tempfile.mktemp()
    stream = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    print(len(re.findall(r'<heap nr=', open(path).read())))
    os.unlink(path)
""")


def arenas(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", COUNT_ARENAS, mode], env=env, capture_output=True, text=True,
                         check=True, timeout=60)
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")
def test_threads_that_allocate_at_once_share_at_most_the_bounded_arenas():
    from nodeagent.heap import ARENAS

    assert arenas("free") > ARENAS
    assert arenas("bounded") <= ARENAS
