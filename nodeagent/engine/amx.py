"""The int4 prefill on Intel AMX (`int4_amx.c`), built with the system's C compiler on first use.

torch's int4 kernel unpacks its weights again for every four rows, so a prefill chunk costs its
rows times a decode step's projections. On a processor with AMX tiles, `int4_amx.c` unpacks
each block of weights once per chunk into bf16 tiles and lets the tile unit multiply them.
Where the processor, the compiler or torch's packing does not fit, `int4_kernel` is None and
prefill stays on torch's paths; `SUPERFLUID_AMX=0` turns it off. The kernel reads torch's AVX-512
packing (blocks of 64 output rows), which the caller checks (`Int4Linear.unpack_prefill`).

The library is cached under `$XDG_CACHE_HOME/superfluid` (else `~/.cache/superfluid`), named
by a hash of its source and flags, so a changed source builds afresh.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_amx.c")
FLAGS = ["-O2", "-fPIC", "-shared", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
         "-mamx-tile", "-mamx-bf16"]
#: What /proc/cpuinfo must list for the kernel's instructions.
CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}
#: The packed layout the kernel reads: torch's AVX-512 int4 packing, 64 output rows a block.
BLOCK_ROWS = 64
#: The AMX tile's depth in bf16 values: columns and quantization groups come in multiples.
TILE_DEPTH = 32
COMPILE_TIMEOUT_S = 120


class Int4Kernel:
    """`sf_int4_mm` of the built library: bf16 rows times a packed int4 weight."""

    def __init__(self, library: ctypes.CDLL):
        self._mm = library.sf_int4_mm
        self._mm.restype = ctypes.c_int
        self._mm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4

    def fits(self, out_features: int, in_features: int, group: int) -> bool:
        return out_features % BLOCK_ROWS == 0 and in_features % TILE_DEPTH == 0 and group % TILE_DEPTH == 0

    def __call__(self, rows: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int) -> torch.Tensor:
        """rows [m, k] bf16 contiguous times the weight of `packed` [n, k/2] and `pairs`
        [k/group, n, 2] bf16, as [m, n] bf16."""
        count, columns = rows.shape
        out = torch.empty(count, packed.shape[0], dtype=torch.bfloat16)
        if self._mm(rows.data_ptr(), packed.data_ptr(), pairs.data_ptr(), out.data_ptr(),
                    count, packed.shape[0], columns, group):
            raise MemoryError("the AMX int4 kernel could not allocate its unpack buffer")
        return out


@functools.cache
def int4_kernel() -> Int4Kernel | None:
    """The AMX kernel where this process can run it, else None (the reason is logged)."""
    reason = _unusable()
    if reason is None:
        try:
            library = ctypes.CDLL(str(_built()))
        except subprocess.CalledProcessError as error:
            reason = f"building it failed: {error.stderr.decode(errors='replace').strip()[-500:]}"
        except (OSError, subprocess.SubprocessError) as error:
            reason = f"building it failed: {error}"
        else:
            if library.sf_amx_enable():
                return Int4Kernel(library)
            reason = "the kernel refused the tile state to this process"
    log.info("AMX int4 prefill not used: %s", reason)
    return None


def _unusable() -> str | None:
    """Why the kernel cannot run here, or None."""
    if os.environ.get("SUPERFLUID_AMX", "1") == "0":
        return "SUPERFLUID_AMX=0"
    missing = CPU_FLAGS - _cpu_flags()
    if missing:
        return "the processor lacks " + ", ".join(sorted(missing))
    if _compiler() is None:
        return "no C compiler (cc or gcc) on PATH"
    return None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _built() -> Path:
    """The library for this source and these flags, compiled once into the cache."""
    compiler = _compiler()
    assert compiler is not None
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"int4_amx-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)], check=True, capture_output=True,
                           timeout=COMPILE_TIMEOUT_S)
            built.replace(target)
    return target


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "superfluid"
