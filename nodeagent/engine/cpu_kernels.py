"""The node's quantized CPU kernels (`cpu_kernels.c`), built with the system's C compiler on first use.

They multiply int4 or int8 weights in groups of 32 by activations quantized per group of 32 to
12-bit integers, in integer arithmetic: AVX-512 VNNI for calls of a few rows (decode), AMX int8
tiles for more (prefill) where the processor has them, and on processors without AVX-512 VNNI an
AVX2 build of the vector path. Every sum is exact, so every path and build gives the same bits and a
row's products never depend on the rows beside it: a prompt prefilled in one chunk and the same
tokens decoded one by one agree to the bit. What follows a product in a Llama layer (rotary
positions on q and k, the MLP's gated unit, the residual sum) can run in the same call, row by
row (`Epilogue`), so a layer on the kernels runs no torch op beside its five calls, and a
model's whole stack of layers can run as one call a step (`LayerStack`, cpu_layers.h). The weights
are never rounded (each group's scale, and minimum for int4, are fp16 as in a GGUF file), and
activations keep 12 bits against the largest of their group, where torch's weight-only kernels
round them to bf16.

Where the processor, the compiler or a projection's shape does not fit, `cpu_kernels` is None
and projections run on torch's kernels. `SUPERFLUID_CPU_KERNELS=0` turns them off,
`SUPERFLUID_CPU_KERNELS=avx2` takes the AVX2 build where AVX-512 would run, and
`SUPERFLUID_AMX=0` keeps them off the tiles. The library is cached under
`$XDG_CACHE_HOME/superfluid` (else `~/.cache/superfluid`), named by a hash of its sources and flags.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nodeagent.engine.kvpool import BLOCK_TOKENS

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
#: The files `SOURCE` includes: one for each build, the attention kernel and the layer stack.
HEADERS = [SOURCE.with_name(name)
           for name in ("cpu_kernels_avx512.h", "cpu_kernels_avx2.h", "cpu_attention.h", "cpu_layers.h")]
COMMON_FLAGS = ["-O2", "-fPIC", "-shared", "-fopenmp"]
TILE_CPU_FLAGS = {"amx_tile", "amx_int8"}


@dataclass(frozen=True)
class Build:
    """One build of the kernels: what /proc/cpuinfo must list for it, and its compiler flags."""

    name: str
    #: What the serving line calls its vector path.
    label: str
    cpu_flags: frozenset[str]
    flags: tuple[str, ...]
    #: Whether it has the AMX tile path.
    tiles: bool


#: The builds, best first.
BUILDS = (
    Build("avx512", "AVX-512 VNNI", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
          ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8"), tiles=True),
    Build("avx2", "AVX2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c", "-DSF_AVX2"),
          tiles=False),
)
#: Outputs the tile path takes at once; inputs per scale (a GGUF Q4 block).
BLOCK_OUTPUTS, GROUP = 64, 32
#: The scales' type: a GGUF block's, so a Q4_0, Q4_1 or Q8_0 file's weights stay exact.
SCALE_DTYPE = torch.float16
#: From this many rows on a call runs on the tiles: below it the vector path is faster.
TILE_ROWS = 4
COMPILE_TIMEOUT_S = 120
#: Head sizes the attention kernel takes: multiples of one KV block's 16 tokens, up to its stack's.
ATTENTION_HEAD_DIMS = range(16, 257, 16)
#: What the attention kernel's pool may hold: the model's fp32, or fp16 at half the bytes.
KERNEL_KV_DTYPES = (torch.float32, torch.float16)


class AttentionCall(ctypes.Structure):
    """`attention_call` of cpu_attention.h."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("new_kv", ctypes.c_void_p),
        ("q_stride", ctypes.c_long),
        ("kv_stride", ctypes.c_long),
        ("plane", ctypes.c_long),
        *((name, ctypes.c_void_p) for name in ("slots", "pool", "blocks", "starts", "counts", "out")),
        *((name, ctypes.c_int)
          for name in ("batch", "chunk", "heads", "kv_heads", "head_dim", "table", "window", "half")),
    ]


class Epilogue(ctypes.Structure):
    """`epilogue` of cpu_kernels.c: what a product does to each row once its sums are in."""

    _fields_ = [("rotary", ctypes.c_void_p), ("rotated", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("gated", ctypes.c_int), ("residual", ctypes.c_void_p)]


#: A row of 2 n sums becomes silu(first n) * last n: the gated unit of a Llama MLP.
GATED = Epilogue(gated=1)


class PackedWeight(ctypes.Structure):
    """`weight` of cpu_kernels.c: codes and scales in the kernels' layouts, and the code width."""

    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("bits", ctypes.c_int)]


class LayerWeights(ctypes.Structure):
    """`layer_weights` of cpu_layers.h."""

    _fields_ = [*((name, PackedWeight) for name in ("qkv", "o", "gate_up", "down")),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)]


class StackCall(ctypes.Structure):
    """`layer_stack` of cpu_layers.h."""

    _fields_ = [("layers", ctypes.POINTER(LayerWeights)), ("n_layers", ctypes.c_int), ("pool", ctypes.c_void_p),
                ("pool_layer", ctypes.c_long), ("attention", AttentionCall), ("rotary", ctypes.c_void_p),
                *((name, ctypes.c_int) for name in ("hidden", "intermediate", "tile_rows")), ("eps", ctypes.c_float)]


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer's part of a `LayerStack`: its products on the kernels and its norms."""

    qkv: BoundWeight
    o: BoundWeight
    gate_up: BoundWeight
    down: BoundWeight
    input_norm: torch.Tensor
    post_norm: torch.Tensor


@dataclass(frozen=True)
class StackShape:
    """What a `LayerStack` needs of the model's shape."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    window: int


class CpuKernels:
    """The built library's entry points: `sf_int4_mm` and `sf_int8_mm` (fp32 rows times a
    quantized weight in the kernels' layouts), the paged attention, the int8 head's chosen
    products and the layer stack."""

    def __init__(self, library: ctypes.CDLL, build: Build, tiles: bool):
        self._int4 = library.sf_int4_mm
        self._int8 = library.sf_int8_mm
        for product in (self._int4, self._int8):
            product.restype = ctypes.c_int
            product.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [
                ctypes.c_void_p, ctypes.c_float, ctypes.POINTER(Epilogue)]
        self._attention = library.sf_paged_attention
        self._attention.restype = ctypes.c_int
        self._attention.argtypes = [ctypes.POINTER(AttentionCall)]
        self._chosen = library.sf_int8_chosen
        self._chosen.restype = None
        self._chosen.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
        self._layers = library.sf_llama_layers
        self._layers.restype = ctypes.c_int
        self._layers.argtypes = [ctypes.c_void_p, ctypes.POINTER(StackCall)]
        self.build = build
        #: Whether calls of `TILE_ROWS` rows or more run on AMX tiles.
        self.tiles = tiles

    @property
    def _tile_rows(self) -> int | None:
        return TILE_ROWS if self.tiles else None

    @property
    def name(self) -> str:
        return "AMX" if self.tiles else self.build.label

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        return out_features % BLOCK_OUTPUTS == 0 and in_features % GROUP == 0

    @staticmethod
    def pack_int4(codes: torch.Tensor) -> torch.Tensor:
        """Codes 0..15 [n, k] in the int4 layout: for each 16 outputs and 8 inputs, 64 bytes
        whose byte 4 i + j holds output i's code at input j (low nibble) and j + 4 (high)."""
        n, k = codes.shape
        quads = codes.to(torch.uint8).view(n // 16, 16, k // 8, 2, 4).permute(0, 2, 1, 4, 3)
        return (quads[..., 0] | (quads[..., 1] << 4)).contiguous().view(n, k // 2)

    @staticmethod
    def unpack_int4(packed: torch.Tensor, outputs: torch.Tensor | None = None) -> torch.Tensor:
        """The codes [n, k] of a packed int4 weight (`pack_int4` undone), or those of the
        `outputs` rows only."""
        n, k = packed.shape[0], packed.shape[1] * 2
        bytes_ = _rows_of(packed.view(n // 16, k // 8, 16, 4), outputs)
        return torch.stack([bytes_ & 15, bytes_ >> 4], -2).reshape(-1, k)

    @staticmethod
    def pack_int8(codes: torch.Tensor) -> torch.Tensor:
        """Codes [n, k] int8 in the int8 layout: for each 16 outputs and 4 inputs, 64 bytes whose
        byte 4 i + j holds output i's code at input j."""
        n, k = codes.shape
        return codes.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(n, k)

    @staticmethod
    def unpack_int8(packed: torch.Tensor, outputs: torch.Tensor | None = None) -> torch.Tensor:
        """The codes [n, k] of a packed int8 weight, or those of the `outputs` rows only."""
        n, k = packed.shape
        return _rows_of(packed.view(n // 16, k // 4, 16, 4), outputs).reshape(-1, k)

    @staticmethod
    def pack_scales(*per_group: torch.Tensor) -> torch.Tensor:
        """Per-group values [n, k/32] in fp16 (scale, and for int4 minimum) in the kernels' layout
        [n/16, k/32, values, 16]: each 16 outputs' values group after group."""
        n, groups = per_group[0].shape
        stacked = torch.stack([values.view(n // 16, 16, groups) for values in per_group], 2)
        return stacked.permute(0, 3, 2, 1).contiguous()

    @staticmethod
    def unpack_scales(packed: torch.Tensor, outputs: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The [n, k/32] values `pack_scales` took, or the `outputs` rows only."""
        if outputs is None:
            outputs = torch.arange(packed.shape[0] * 16)
        return [packed[outputs // 16, :, i, outputs % 16] for i in range(packed.shape[2])]

    def int4(self, rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """rows [m, k] fp32 contiguous times w = scale * code + minimum (`packed` [n, k/2] from
        `pack_int4`, `scales` from `pack_scales(scale, minimum)`), as [m, n] fp32."""
        return self.bound(4, packed, scales)(rows)

    def int8(self, rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """rows [m, k] fp32 contiguous times w = scale * code (`packed` [n, k] int8 from
        `pack_int8`, `scales` from `pack_scales(scale)`), as [m, n] fp32."""
        return self.bound(8, packed, scales)(rows)

    def int8_chosen(self, rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    chosen: torch.Tensor) -> torch.Tensor:
        """rows [m, k] fp32 contiguous times the outputs `chosen` [m, j] (int64, contiguous) of an
        int8 weight in the kernels' layouts, as [m, j] fp32: each in fp32 from the codes and scales
        themselves, no activation rounded."""
        out = torch.empty(chosen.shape)
        self._chosen(rows.data_ptr(), packed.data_ptr(), scales.data_ptr(), chosen.data_ptr(), out.data_ptr(),
                     *chosen.shape, rows.shape[1])
        return out

    def bound(self, bits: int, packed: torch.Tensor, scales: torch.Tensor) -> BoundWeight:
        """The product by one packed weight, for a projection to call at every step."""
        columns = packed.shape[1] * (2 if bits == 4 else 1)
        return BoundWeight(self._int4 if bits == 4 else self._int8, packed, scales, bits, columns, self._tile_rows)

    def layer_stack(self, layers: list[StackLayer], shape: StackShape) -> LayerStack:
        """A decoder's layers as one call a step, with the bits of their calls one by one."""
        return LayerStack(self._layers, layers, shape, self._tile_rows)

    def attention(self, pool: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
                  blocks: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, window: int) -> torch.Tensor:
        """Stores kv [B,C,2,KV,hd] at `slots` [B*C] of `pool` (one layer of `KVPool.kv`), then
        attends q [B,C,H,hd] to each lane's blocks [B,NB]: row i of lane b sits at position
        starts[b] + i and sees the keys up to it (the last `window` of them where window > 0);
        rows from counts[b] on are padding and give 0. Returns [B,C,H*hd] fp32."""
        return self.attention_step(slots, blocks, starts, counts, window)(pool, q, kv)

    def attention_step(self, slots: torch.Tensor, blocks: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                       window: int) -> AttentionStep:
        """`attention` with one step's lanes bound, for each layer to call with its pool, q and kv."""
        return AttentionStep(self._attention, slots, blocks, starts, counts, window)


class AttentionStep:
    """One step's attention call: what every layer shares is set once, and each layer's call
    fills in its own pool, q, kv and output."""

    def __init__(self, function: Callable[..., int], slots: torch.Tensor, blocks: torch.Tensor,
                 starts: torch.Tensor, counts: torch.Tensor, window: int):
        self._function = function
        self._held = (slots, blocks, starts, counts)  # the pointers below stay theirs
        self._call = AttentionCall(slots=slots.data_ptr(), blocks=blocks.data_ptr(), starts=starts.data_ptr(),
                                   counts=counts.data_ptr(), table=blocks.shape[1], window=window)

    def __call__(self, pool: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        call = self._call
        call.batch, call.chunk, call.heads, call.head_dim = batch, chunk, heads, head_dim = q.shape
        (q, call.q_stride), (kv, call.kv_stride) = _token_rows(q), _token_rows(kv)
        out = torch.empty(batch, chunk, heads * head_dim)
        call.q, call.new_kv = q.data_ptr(), kv.data_ptr()
        call.pool, call.out, call.kv_heads = pool.data_ptr(), out.data_ptr(), kv.shape[3]
        call.plane, call.half = _pool_layout(pool)
        if self._function(ctypes.byref(call)):
            raise MemoryError("the CPU attention kernel could not allocate its buffers")
        return out


def _pool_layout(layer: torch.Tensor) -> tuple[int, int]:
    """The stride of one KV head's plane in a layer's pool [2,KV,blocks,16,hd], and whether it
    holds fp16 (else fp32); its blocks and what they hold must lie as `KVPool.kv` lays them."""
    head_dim, planes = layer.shape[-1], layer.shape[1]
    if layer.stride()[2:] != (BLOCK_TOKENS * head_dim, head_dim, 1) or layer.stride(0) != planes * layer.stride(1):
        raise ValueError("the CPU attention kernel takes a layer's pool laid out as KVPool.kv lays it")
    if layer.dtype not in KERNEL_KV_DTYPES:
        raise ValueError(f"the CPU attention kernel takes an fp32 or fp16 pool, not {layer.dtype}")
    return layer.stride(1), int(layer.dtype == torch.float16)


def _token_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t [B,C,...] as the kernel reads it, each token's part contiguous and token (b, c) at
    (b * C + c) * stride from the start, with that stride; copied only where t is not so."""
    shape, strides = t.shape, t.stride()
    inner = 1
    for size, stride in zip(reversed(shape[2:]), reversed(strides[2:]), strict=True):
        if stride != inner and size > 1:
            return _copied(t)
        inner *= size
    batch, chunk = shape[:2]
    step = strides[1] if chunk > 1 else strides[0] if batch > 1 else inner
    if batch > 1 and chunk > 1 and strides[0] != chunk * step:
        return _copied(t)
    return t, step


def _copied(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t dense in row-major order, whatever strides its size-1 dimensions report: tokens one
    token's size apart."""
    return t.contiguous(), math.prod(t.shape[2:])


class BoundWeight:
    """rows [..., k] fp32 contiguous times one packed weight, as [..., n] fp32. Its pointers and
    shape are worked out once: a decode step makes over a hundred of these calls, each a few
    microseconds of the kernel's own."""

    def __init__(self, function: Callable[..., int], packed: torch.Tensor, scales: torch.Tensor, bits: int,
                 columns: int, tile_rows: int | None):
        self._function = function
        self._held = (packed, scales)  # the pointers below stay theirs
        self._weight = (packed.data_ptr(), scales.data_ptr())
        self.packed = PackedWeight(*self._weight, bits)
        self._outputs, self._columns, self._tile_rows = packed.shape[0], columns, tile_rows

    def __call__(self, rows: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
                 then: Epilogue | None = None) -> torch.Tensor:
        """`norm` (fp32 [k], contiguous): the rows are RMSNormed with it and `eps` first, in the
        kernel's own pass over them. `then`: each row's outputs go through it (n / 2 of them
        where it is gated)."""
        out = torch.empty(*rows.shape[:-1], self._outputs // 2 if then is not None and then.gated else self._outputs)
        count = rows.numel() // self._columns
        tile_rows = _tile_path_from(self._tile_rows, count)
        if self._function(rows.data_ptr(), *self._weight, out.data_ptr(), count, self._outputs, self._columns,
                          tile_rows, None if norm is None else norm.data_ptr(), eps, then):
            raise MemoryError("the CPU kernel could not allocate its buffers")
        return out


class LayerStack:
    """x [B,C,D] through every decoder layer in one call (`sf_llama_layers`), in place. Each layer
    makes the calls `LlamaModel.layer` makes on the kernels, so the bits are the same; the Python
    between them is what goes."""

    def __init__(self, function: Callable[..., int], layers: list[StackLayer], shape: StackShape,
                 tile_rows: int | None):
        self._function = function
        table = (LayerWeights * len(layers))(*(
            LayerWeights(layer.qkv.packed, layer.o.packed, layer.gate_up.packed, layer.down.packed,
                         layer.input_norm.data_ptr(), layer.post_norm.data_ptr())
            for layer in layers))
        self._template = StackCall(n_layers=len(layers), hidden=shape.hidden,
                                   intermediate=shape.intermediate, eps=shape.eps)
        self._template.attention = AttentionCall(heads=shape.heads, kv_heads=shape.kv_heads,
                                                 head_dim=shape.head_dim, window=shape.window)
        self._layers, self._table = layers, table  # the pointers above stay theirs
        self._tile_rows = tile_rows

    def __call__(self, x: torch.Tensor, rotary: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                 blocks: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                 layers: range | None = None) -> torch.Tensor:
        """x [B,C,D] fp32 contiguous through `layers` (default: all), `rotary` each row's
        rotations (complex64 [B,C,1,hd/2], contiguous), `pool` those layers' KV blocks one layer
        after another (`KVPool.kv`, or a stride of 0 for one layer's blocks that each layer
        overwrites); the rest as `CpuKernels.attention` takes them. Calls from several threads
        at once each fill in their own copy of the call."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 3 or x.shape[-1] != self._template.hidden:
            raise ValueError(f"the layer stack takes fp32 rows of {self._template.hidden} [B,C,D], contiguous")
        if not one_rotation_a_row(rotary, x):
            raise ValueError("the layer stack takes one contiguous complex64 rotation for each row")
        layers = range(self._template.n_layers) if layers is None else layers
        if layers.step != 1 or not 0 <= layers.start <= layers.stop <= self._template.n_layers:
            raise ValueError(f"the layer stack runs a range of its {self._template.n_layers} layers")
        if pool.shape[0] != len(layers):
            raise ValueError(f"the pool holds {pool.shape[0]} layers for a run of {len(layers)}")
        call = StackCall.from_buffer_copy(self._template)
        first = ctypes.addressof(self._table) + layers.start * ctypes.sizeof(LayerWeights)
        call.layers = ctypes.cast(first, ctypes.POINTER(LayerWeights))
        call.n_layers = len(layers)
        lanes = call.attention
        lanes.batch, lanes.chunk = x.shape[:2]
        lanes.slots, lanes.blocks, lanes.starts, lanes.counts = (
            slots.data_ptr(), blocks.data_ptr(), starts.data_ptr(), counts.data_ptr())
        lanes.table = blocks.shape[1]
        call.pool, call.pool_layer, call.rotary = pool.data_ptr(), pool.stride(0), rotary.data_ptr()
        lanes.plane, lanes.half = _pool_layout(pool[0])
        call.tile_rows = _tile_path_from(self._tile_rows, lanes.batch * lanes.chunk)
        status = self._function(x.data_ptr(), ctypes.byref(call))
        if status == -1:
            raise MemoryError("the CPU kernels could not allocate their buffers")
        if status:
            raise ValueError(f"the CPU attention kernel does not take a head size of {lanes.head_dim}")
        return x


def _tile_path_from(tile_rows: int | None, rows: int) -> int:
    """The rows from which a call of `rows` takes the tile path: more than it has where the
    process has no tiles (`tile_rows` None)."""
    return rows + 1 if tile_rows is None else tile_rows


def one_rotation_a_row(rotary: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether `rotary` ([..., 1, head_dim / 2] complex) holds its own rotations for each row of
    `rows` [..., k], as the kernels read them: not broadcast over rows, complex64 and contiguous."""
    return rotary.dtype == torch.complex64 and rotary.is_contiguous() and rotary.shape[:-2] == rows.shape[:-1]


def _rows_of(blocked: torch.Tensor, outputs: torch.Tensor | None) -> torch.Tensor:
    """From codes blocked [n / 16, steps, 16, 4]: every output's [n, steps, 4], or the chosen ones'."""
    if outputs is None:
        return blocked.permute(0, 2, 1, 3).reshape(-1, *blocked.shape[1:2], 4)
    return blocked[outputs // 16, :, outputs % 16, :]


def attending_kernels(device: torch.device, dtype: torch.dtype, head_dim: int,
                      kv_dtype: torch.dtype) -> CpuKernels | None:
    """The kernels where they attend for a model of `dtype` on `device` with heads of `head_dim`
    over KV blocks of `kv_dtype`: an fp32 model on the CPU, a head size they take, an fp32 or
    fp16 pool; else None."""
    if device.type != "cpu" or dtype != torch.float32 or head_dim not in ATTENTION_HEAD_DIMS:
        return None
    return cpu_kernels() if kv_dtype in KERNEL_KV_DTYPES else None


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The kernels where this process can run them, else None (the reason is logged). A build
    that fails to compile (an older compiler may lack the AMX flags) gives way to the next."""
    builds, reason = _builds_for_here()
    failures = []
    for build in builds:
        kernels = load(build)
        if isinstance(kernels, CpuKernels):
            return kernels
        failures.append(f"the {build.name} build: {kernels}")
    log.info("the node's CPU kernels are not used: %s", "; ".join(failures) or reason)
    return None


def load(build: Build) -> CpuKernels | str:
    """`build` compiled (once) and loaded, or why it could not be."""
    try:
        library = ctypes.CDLL(str(_built(build)))
    except subprocess.CalledProcessError as error:
        return f"building it failed: {error.stderr.decode(errors='replace').strip()[-500:]}"
    except (OSError, subprocess.SubprocessError) as error:
        return f"building it failed: {error}"
    return CpuKernels(library, build, build.tiles and _tiles(library))


def _tiles(library: ctypes.CDLL) -> bool:
    """Whether the tile path can run: the processor has it, it is not switched off, and Linux
    lends this process the tile state."""
    if os.environ.get("SUPERFLUID_AMX", "1") == "0" or TILE_CPU_FLAGS - _cpu_flags():
        return False
    if library.sf_amx_enable():
        return True
    log.info("the node's CPU kernels stay off the AMX tiles: Linux refused the tile state to this process")
    return False


def _builds_for_here() -> tuple[list[Build], str]:
    """The builds this processor runs, best first, or only the one `SUPERFLUID_CPU_KERNELS`
    names; where there are none, why."""
    asked = os.environ.get("SUPERFLUID_CPU_KERNELS", "1")
    if asked == "0":
        return [], "SUPERFLUID_CPU_KERNELS=0"
    named = named_build(asked)
    if asked != "1" and named is None:
        log.warning("SUPERFLUID_CPU_KERNELS=%s is none of 0, 1, %s; taking the best build here",
                    asked, ", ".join(build.name for build in BUILDS))
    if _compiler() is None:
        return [], "no C compiler (cc or gcc) on PATH"
    candidates = list(BUILDS) if named is None else [named]
    runs = [build for build in candidates if runnable(build)]
    return runs, "" if runs else "the processor lacks " + ", ".join(sorted(candidates[-1].cpu_flags - _cpu_flags()))


def named_build(name: str) -> Build | None:
    """The build called `name` ("avx512", "avx2"), or None."""
    return next((build for build in BUILDS if build.name == name), None)


def runnable(build: Build) -> bool:
    """Whether this processor has what `build` needs."""
    return build.cpu_flags <= _cpu_flags()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_command(build: Build) -> list[str]:
    """The compiler and its flags for `build`, short of the output and the source."""
    compiler = _compiler()
    assert compiler is not None
    return [compiler, *COMMON_FLAGS, *build.flags]


def _built(build: Build) -> Path:
    """The library for these sources and this build's flags, compiled once into the cache."""
    command = compile_command(build)
    sources = b"".join(path.read_bytes() for path in [SOURCE, *HEADERS])
    digest = hashlib.sha256(sources + " ".join(command).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{build.name}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            subprocess.run([*command, "-o", str(built), str(SOURCE)], check=True, capture_output=True,
                           timeout=COMPILE_TIMEOUT_S)
            built.replace(target)
    return target


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "superfluid"
