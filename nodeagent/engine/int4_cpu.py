"""The int4 CPU kernel (`int4_cpu.c`), built with the system's C compiler on first use.

It multiplies int4 weights by activations quantized per group of 32 to 16-bit integers, in
integer arithmetic: AVX-512 VNNI for calls of a few rows (decode), AMX int8 tiles for more
(prefill) where the processor has them. Every sum is exact, so the two paths give the same bits
and a row's products never depend on the rows beside it: a prompt prefilled in one chunk and the
same tokens decoded one by one agree to the bit. The weights are never rounded (the scale and
minimum of each group stay fp32), and activations keep 16 bits against the largest of their
group, where torch's int4 kernel rounds them to bf16.

Where the processor, the compiler or the projection's shape does not fit, `int4_kernel` is None
and int4 projections run on torch's kernel; `SUPERFLUID_INT4_KERNEL=0` turns it off, and
`SUPERFLUID_AMX=0` keeps it off the tiles. The library is cached under `$XDG_CACHE_HOME/superfluid`
(else `~/.cache/superfluid`), named by a hash of its source and flags.
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

SOURCE = Path(__file__).with_name("int4_cpu.c")
FLAGS = ["-O2", "-fPIC", "-shared", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
         "-mamx-tile", "-mamx-int8"]
#: What /proc/cpuinfo must list for the kernel's vector path, and for its tile path.
VECTOR_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
TILE_CPU_FLAGS = {"amx_tile", "amx_int8"}
#: Outputs the tile path takes at once; inputs per scale (a GGUF Q4 block).
BLOCK_OUTPUTS, GROUP = 64, 32
#: From this many rows on a call runs on the tiles: below it the vector path is faster.
TILE_ROWS = 4
COMPILE_TIMEOUT_S = 120


class Int4Kernel:
    """`sf_int4_mm` of the built library: fp32 rows times an int4 weight in this kernel's layout."""

    def __init__(self, library: ctypes.CDLL, tiles: bool):
        self._mm = library.sf_int4_mm
        self._mm.restype = ctypes.c_int
        self._mm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
        #: Whether calls of `TILE_ROWS` rows or more run on AMX tiles.
        self.tiles = tiles

    @property
    def name(self) -> str:
        return "AMX" if self.tiles else "AVX-512 VNNI"

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        return out_features % BLOCK_OUTPUTS == 0 and in_features % GROUP == 0

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        """Codes 0..15 [n, k] in the kernel's layout: for each 16 outputs and 8 inputs, 64 bytes
        whose byte 4 i + j holds output i's code at input j (low nibble) and j + 4 (high)."""
        n, k = codes.shape
        quads = codes.to(torch.uint8).view(n // 16, 16, k // 8, 2, 4).permute(0, 2, 1, 4, 3)
        return (quads[..., 0] | (quads[..., 1] << 4)).contiguous().view(n, k // 2)

    @staticmethod
    def unpack(packed: torch.Tensor) -> torch.Tensor:
        """The codes [n, k] of a packed weight (`pack` undone)."""
        n, k = packed.shape[0], packed.shape[1] * 2
        bytes_ = packed.view(n // 16, k // 8, 16, 4)
        quads = torch.stack([bytes_ & 15, bytes_ >> 4], -1)
        return quads.permute(0, 2, 1, 4, 3).reshape(n, k)

    def __call__(self, rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 minimum: torch.Tensor) -> torch.Tensor:
        """rows [m, k] fp32 contiguous times the weight w = scale * code + minimum, with `packed`
        [n, k/2] and scale and minimum [k/32, n] fp32, as [m, n] fp32."""
        count, columns = rows.shape
        out = torch.empty(count, packed.shape[0])
        tile_rows = TILE_ROWS if self.tiles else count + 1
        if self._mm(rows.data_ptr(), packed.data_ptr(), scale.data_ptr(), minimum.data_ptr(), out.data_ptr(),
                    count, packed.shape[0], columns, tile_rows):
            raise MemoryError("the int4 kernel could not allocate its buffers")
        return out


@functools.cache
def int4_kernel() -> Int4Kernel | None:
    """The kernel where this process can run it, else None (the reason is logged)."""
    reason = _unusable()
    if reason is None:
        try:
            library = ctypes.CDLL(str(_built()))
        except subprocess.CalledProcessError as error:
            reason = f"building it failed: {error.stderr.decode(errors='replace').strip()[-500:]}"
        except (OSError, subprocess.SubprocessError) as error:
            reason = f"building it failed: {error}"
        else:
            return Int4Kernel(library, _tiles(library))
    log.info("int4 CPU kernel not used: %s", reason)
    return None


def _tiles(library: ctypes.CDLL) -> bool:
    """Whether the tile path can run: the processor has it, it is not switched off, and Linux
    lends this process the tile state."""
    if os.environ.get("SUPERFLUID_AMX", "1") == "0" or TILE_CPU_FLAGS - _cpu_flags():
        return False
    if library.sf_amx_enable():
        return True
    log.info("int4 CPU kernel off the AMX tiles: Linux refused the tile state to this process")
    return False


def _unusable() -> str | None:
    """Why the kernel cannot run here, or None."""
    if os.environ.get("SUPERFLUID_INT4_KERNEL", "1") == "0":
        return "SUPERFLUID_INT4_KERNEL=0"
    missing = VECTOR_CPU_FLAGS - _cpu_flags()
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
    target = _cache_dir() / f"int4_cpu-{digest}.so"
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
