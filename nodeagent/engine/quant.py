"""Weights kept quantized in memory: int8 per output channel, or int4 in groups of 32.

A decode step reads every weight once, so on the CPU its cost is the bytes of its weights.
These projections hold a quarter (int8) or an eighth (int4) of the fp32 bytes:

- int8: symmetric groups of 32 (GGUF Q8_0 exactly) on the node's own kernel where the processor
  has AVX-512 VNNI or AVX2 (`cpu_kernels.py`), else torch's `_weight_int8pack_mm`, one scale an output row.
- int4: asymmetric groups of 32 (a scale and a minimum per group, which is GGUF Q4_0 and Q4_1
  exactly), on the node's own kernel likewise, else torch's `_weight_int4pack_mm_for_cpu`.

torch's kernels are weight-only: activations go through them as bf16. The node's kernels keep
12 bits of each activation against the largest of its group of 32 instead, and sum exactly. Neither
quantizes activations per tensor as fbgemm's int8 linear does (faster still, but the outlier
channels of real models make that lose the top token too often). The lm_head and the embedding
are int8 in either format: they are often the file's most precise tensors, and the logits are
what sampling reads.

Which one pays depends on the processor (AVX-512 or AVX2, bf16 or not), so `auto` measures
each against float on this machine before it picks one (`kernel_speedups`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nodeagent.engine import cpu_kernels
from nodeagent.engine.choices import WeightFormat
from nodeagent.engine.linear import Linear, padded_rows
from nodeagent.engine.rope import rotate_in_place

#: A GGUF Q4 and Q8_0 block; the node's CPU kernels (`cpu_kernels.py`) take the same groups.
GROUP = cpu_kernels.GROUP
#: The int4 kernel packs output rows in tiles of 16.
INT4_ROW_TILE = 16
#: How close to a 4-bit grid (in shares of the group's range) a dequantized weight must lie for
#: `grid_steps` to keep its code: far above float32's rounding of a dequantized value, far
#: below the chance that 32 float weights fall on a grid.
GRID_TOLERANCE = 1e-4
#: The int8 kernel reads past the end of rows of other lengths (it crashed on some).
INT8_COLUMN_MULTIPLE = 16
#: `auto` takes a quantized kernel only when it runs the probe in at most this share of float's
#: time: the margin keeps measurement noise from picking a kernel that is no faster.
AUTO_MAX_TIME_SHARE = 0.8
#: From this many rows on (a prefill chunk), an int4 product may unpack its weight to bf16 and
#: run one GEMM (`Int4Linear.unpack_prefill`): the kernel's time grows with its rows as a
#: matrix-vector product's does, a GEMM's far less.
UNPACK_ROWS = 64
#: An unpacked weight is made and multiplied a slice of its output rows at a time, each at most
#: this many bytes: the GEMM then reads a slice the cache still holds, and the slices reuse
#: heap memory where a whole big weight would be fresh pages from the kernel every time.
UNPACK_SLICE_BYTES = 4 * 2**20


class WeightFormatError(Exception):
    """A weight format this device or torch cannot run."""


@dataclass(frozen=True)
class Quantization:
    """The format the model's projections take, and why (for the serving line)."""

    format: WeightFormat
    reason: str


def choose_format(asked: WeightFormat, device: torch.device, file_bits: int | None) -> Quantization:
    """The format to load with. `file_bits` is what the checkpoint stores its projections in
    (4 for GGUF Q4_*, 8 for Q8_0, None for float checkpoints). `auto` keeps a quantized file
    quantized with the closest kernel that beats float here, and leaves float files float."""
    if asked == WeightFormat.FLOAT:
        return Quantization(WeightFormat.FLOAT, "as asked")
    if asked != WeightFormat.AUTO:
        _check_available(asked, device)
        return Quantization(asked, "as asked")
    if file_bits is None:
        return Quantization(WeightFormat.FLOAT, "a float checkpoint")
    if device.type != "cpu":
        return Quantization(WeightFormat.FLOAT, f"dequantized: no quantized kernel on {device.type} yet")
    speedups = kernel_speedups()
    wanted = [WeightFormat.INT4, WeightFormat.INT8] if file_bits <= 4 else [WeightFormat.INT8]
    for fmt in wanted:
        share = speedups.get(fmt)
        if share is not None and share <= AUTO_MAX_TIME_SHARE:
            return Quantization(fmt, f"the file's {file_bits}-bit weights, {1 / share:.1f}x float's speed here")
    return Quantization(WeightFormat.FLOAT, "dequantized: no quantized kernel beats float here")


def _check_available(fmt: WeightFormat, device: torch.device) -> None:
    if device.type != "cpu":
        raise WeightFormatError(f"--weights {fmt} runs on the CPU only; use --weights float on {device.type}")
    if fmt not in kernel_speedups():
        raise WeightFormatError(f"--weights {fmt}: this torch lacks a working {fmt} CPU kernel")


#: The relative error a working kernel stays under against its own dequantized weight: bf16
#: activations round at 2^-9, summed over a row.
KERNEL_TOLERANCE = 0.01


#: The probe's weights: together past any last-level cache in fp32, as a model's are.
PROBE_SHAPE, PROBE_WEIGHTS = (4096, 2048), 2


@functools.cache
def kernel_speedups() -> dict[WeightFormat, float]:
    """Each working quantized kernel's time over float's for a decode step's products: one row
    against each of two 4096x2048 weights (64 MB in fp32). A kernel that is missing or gives
    wrong products is left out. Takes about a second, once per process."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(*PROBE_SHAPE, generator=generator) * 0.02 for _ in range(PROBE_WEIGHTS)]
    x = torch.randn(1, PROBE_SHAPE[1], generator=generator)
    float_time = _best_time([Linear(w) for w in weights], x)
    shares = {}
    for fmt, kind in ((WeightFormat.INT8, Int8Linear), (WeightFormat.INT4, Int4Linear)):
        try:
            linears = [kind(w) for w in weights]
            reference = F.linear(x, linears[0].dequantized())
            error = (linears[0](x) - reference).norm() / reference.norm()
        except (RuntimeError, AttributeError, NotImplementedError):
            continue
        if error < KERNEL_TOLERANCE:
            shares[fmt] = _best_time(linears, x) / float_time
    return shares


def _best_time(linears: list, x: torch.Tensor, rounds: int = 7) -> float:
    """The best of `rounds` times to multiply x by every one of `linears`."""
    best = float("inf")
    for _ in range(rounds + 1):
        started = time.perf_counter()
        for linear in linears:
            linear(x)
        best = min(best, time.perf_counter() - started)
    return best


def _node_kernels(weight: torch.Tensor) -> cpu_kernels.CpuKernels | None:
    """The node's CPU kernels where they run this weight's device and shape, else None."""
    kernels = cpu_kernels.cpu_kernels() if weight.device.type == "cpu" else None
    return kernels if kernels is not None and kernels.fits(*weight.shape) else None


class Int8Linear:
    """`x @ W.T + b` with W int8: in groups of 32 on the node's kernels, else one scale an
    output row through torch's kernel (x as bf16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        if self.in_features % INT8_COLUMN_MULTIPLE:
            raise WeightFormatError(
                f"an int8 weight needs columns a multiple of {INT8_COLUMN_MULTIPLE}; got {list(weight.shape)}"
            )
        self.kernels = _node_kernels(weight)
        self.product: cpu_kernels.BoundWeight | None = None
        if self.kernels is not None:
            codes, scale = int8_groups(weight.float(), cpu_kernels.SCALE_DTYPE)
            self.codes, self.scales = self.kernels.pack_int8(codes), self.kernels.pack_scales(scale)
            self.product = self.kernels.bound(8, self.codes, self.scales)
        else:
            self.codes, scale = int8_rows(weight.float())
            self.scales = scale.to(torch.bfloat16)
        self.bias = bias
        self.nbytes = self.codes.numel() + _bytes(self.scales) + _bytes(bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.product is not None:
            return _on_kernels(self.product, x, self.bias)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)
        return _finish(y, x, self.bias)

    def weight_rows(self, outputs: torch.Tensor) -> torch.Tensor:
        """The dequantized weight rows [len(outputs), in] of the 1-D index `outputs`."""
        if self.kernels is None:
            return self.codes[outputs].float() * self.scales[outputs].float().unsqueeze(-1)
        codes = self.kernels.unpack_int8(self.codes, outputs).float().view(len(outputs), -1, GROUP)
        [scale] = self.kernels.unpack_scales(self.scales, outputs)
        return (codes * scale.float().unsqueeze(-1)).view(len(outputs), self.in_features)

    def dequantized(self) -> torch.Tensor:
        return self.weight_rows(torch.arange(self.out_features))


class Int8Head(Int8Linear):
    """An int8 lm_head whose highest logits are exact fp32 products of its int8 weights.

    A first pass finds each row's candidates, then the `REFINED` highest are recomputed in fp32
    from the int8 codes and scales, so the top of the distribution, which greedy and top-k
    sampling read, is exact. The first pass is the int8 kernel, whose bf16 output rounds at
    2^-9 of a logit (0.06 near 25, enough to tie or swap near-equal tokens); or, when the caller
    reads only the argmax (`greedy`), an int4 copy of the head (a scout, half the bytes),
    whose other logits are off by up to several units, too far for a sampled token's odds. On
    SmolLM2 the exact argmax was within the scout's top 16 at every one of 11,790 positions."""

    REFINED = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias)
        usable = int4_fits(weight.shape) and WeightFormat.INT4 in kernel_speedups()
        self.scout = Int4Linear(self.dequantized(), bias) if usable else None
        self.nbytes += 0 if self.scout is None else self.scout.nbytes

    def __call__(self, x: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        first = self.scout(rows) if greedy and self.scout is not None else super().__call__(rows)
        logits = first.float()
        top = logits.topk(min(self.REFINED, self.out_features), dim=-1).indices
        exact = self._products(rows, top)
        if self.bias is not None:
            exact += self.bias[top].float()
        return logits.scatter_(1, top, exact).view(*x.shape[:-1], self.out_features)

    def _products(self, rows: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """rows [m, in] times the weight rows `top` [m, j], in fp32."""
        if self.kernels is not None:
            return self.kernels.int8_chosen(rows.contiguous(), self.codes, self.scales, top)
        weights = self.weight_rows(top.flatten()).view(*top.shape, self.in_features)
        return torch.einsum("mkd,md->mk", weights, rows)


class Int4Linear:
    """`x @ W.T + b` with W int4 in asymmetric groups of 32 along each row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        if not int4_fits(weight.shape):
            raise WeightFormatError(
                f"an int4 weight needs rows a multiple of {INT4_ROW_TILE} and columns of {GROUP}; "
                f"got {list(weight.shape)}"
            )
        self.kernels = _node_kernels(weight)
        self.product: cpu_kernels.BoundWeight | None = None
        if self.kernels is not None:
            codes, scale, minimum = int4_groups(weight.float(), cpu_kernels.SCALE_DTYPE)
            self.packed = self.kernels.pack_int4(codes)
            self.scales = self.kernels.pack_scales(scale, minimum)
            self.product = self.kernels.bound(4, self.packed, self.scales)
            scale_bytes = _bytes(self.scales)
        else:
            codes, scale, minimum = int4_groups(weight.float())
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 8)
            # torch's layout: [groups, rows, (scale, zero)], w = (code - 8) * scale + zero.
            pairs = torch.stack([scale, minimum + 8 * scale], -1).transpose(0, 1)
            self.scales_and_zeros = pairs.contiguous().to(torch.bfloat16)
            scale_bytes = self.scales_and_zeros.numel() * 2
        #: Set by `unpack_prefill`: the packed layout's row block, for chunks of many rows.
        self.unpack_width: int | None = None
        self.bias = bias
        self.nbytes = self.packed.numel() + scale_bytes + _bytes(bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.product is not None:
            return _on_kernels(self.product, x, self.bias)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if len(rows) >= UNPACK_ROWS and self.unpack_width is not None:
            y = self._unpacked_product(rows)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_and_zeros)
        return _finish(y, x, self.bias)

    def unpack_prefill(self) -> None:
        """Run chunks of `UNPACK_ROWS` rows or more as one bf16 GEMM on the unpacked weight,
        where this process's layout of torch's kernel is known and the rows fill its blocks.
        Faster, but those rows' products then differ from the kernel's in the last bits (the
        kernel keeps each weight in fp32 and sums in another order), so a token's hidden state
        depends on how its prompt was batched. The exact kernel needs none of this."""
        width = int4_unpack_width()
        if self.kernels is None and width is not None and self.out_features % width == 0:
            self.unpack_width = width

    def _unpacked_product(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows times the unpacked weight, padded to the row counts packed projections run
        at, for the same reason (oneDNN keeps a primitive per row count)."""
        count = len(rows)
        padded = padded_rows(count)
        if padded != count:
            rows = F.pad(rows, (0, 0, 0, padded - count))
        parts = [torch.mm(rows, self.unpacked_t(start, end)) for start, end in self._slices()]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, 1))[:count]

    def _slices(self) -> list[tuple[int, int]]:
        """The output rows [start, end) of each slice `_unpacked_product` unpacks at once."""
        assert self.unpack_width is not None
        width = self.unpack_width
        step = max(1, UNPACK_SLICE_BYTES // (2 * self.in_features * width)) * width
        return [(start, min(start + step, self.out_features)) for start in range(0, self.out_features, step)]

    def unpacked_t(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """W.T [in, out][:, start:end] in bf16, each weight (code - 8) * scale + zero as the
        kernel computes it, unpacked from the kernel's blocks of `unpack_width` rows (`start`
        and `end` fall on block edges)."""
        width = self.unpack_width
        assert width is not None
        end = self.out_features if end is None else end
        blocks, groups, half = (end - start) // width, self.in_features // GROUP, self.in_features // 2
        packed = self.packed.view(-1)[start * half : end * half]
        codes = _blocked_codes(packed, end - start, self.in_features, width).view(torch.int8) - 8
        codes = codes.view(blocks, groups, GROUP, width).to(torch.bfloat16)
        pairs = self.scales_and_zeros[:, start:end].view(groups, blocks, 1, width, 2)
        scale, zero = pairs.permute(4, 1, 0, 2, 3).contiguous()
        weight_t = torch.empty(self.in_features, end - start, dtype=torch.bfloat16)
        blocked = weight_t.view(groups, GROUP, blocks, width).permute(2, 0, 1, 3)
        torch.addcmul(zero, codes, scale, out=blocked)
        return weight_t

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by: from the codes, or from an identity product
        through torch's kernel."""
        if self.kernels is not None:
            codes = self.kernels.unpack_int4(self.packed).float().view(self.out_features, -1, GROUP)
            scale, minimum = self.kernels.unpack_scales(self.scales)
            weight = codes * scale.float()[..., None] + minimum.float()[..., None]
            return weight.view(self.out_features, self.in_features)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_and_zeros)
        return w_t.float().t()


@functools.cache
def int4_unpack_width() -> int | None:
    """The row block of the int4 kernel's packed layout in this process (64 with AVX-512, 32
    with AVX2, 2 without either), found by packing known codes; None where no width unpacks
    them or oneDNN has no bf16 GEMM here, so that every product stays on the kernel."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
    except (AttributeError, RuntimeError):
        return None
    rows, columns = 64, 2 * GROUP
    codes = torch.randint(0, 16, (rows, columns), generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 8)
    for width in (64, 32, 2):
        unpacked = _blocked_codes(packed, rows, columns, width).permute(0, 2, 1).reshape(rows, columns)
        if torch.equal(unpacked.to(torch.int64), codes):
            return width
    return None


def _blocked_codes(packed: torch.Tensor, rows: int, columns: int, width: int) -> torch.Tensor:
    """The codes of a packed int4 weight as [rows / width, columns, width], read as blocks of
    `width` rows whose byte j holds row j (low nibble) and row j + width/2 (high)."""
    halves = packed.view(rows // width, columns, width // 2)
    return torch.cat([halves & 15, halves >> 4], -1)


def normed_projection(
    projection: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, norm: torch.Tensor, eps: float
) -> torch.Tensor:
    """projection(RMSNorm(x) * norm). A projection on the node's CPU kernels takes the norm into
    the pass that quantizes x: one call where torch's norm and the product were two."""
    if isinstance(projection, (Int4Linear, Int8Linear)) and projection.product is not None:
        return _on_kernels(projection.product, x, projection.bias, norm.float().contiguous(), eps)
    return projection(F.rms_norm(x, (x.shape[-1],), norm, eps))


def rotated_projection(
    projection: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, norm: torch.Tensor, eps: float,
    freqs: torch.Tensor, rotated: int, head_dim: int,
) -> torch.Tensor:
    """`normed_projection` with its first `rotated` outputs turned to their positions by `freqs`
    (`rope.rotate_in_place`, [..., 1, head_dim / 2] complex); on the node's kernels, in the same
    call and with the same bits."""
    product = _fusable(projection, x)
    if product is None or not cpu_kernels.one_rotation_a_row(freqs, x):
        y = normed_projection(projection, x, norm, eps)
        rotate_in_place(y[..., :rotated].view(*y.shape[:-1], -1, head_dim), freqs)
        return y
    turn = cpu_kernels.Epilogue(rotary=freqs.data_ptr(), rotated=rotated, head_dim=head_dim)
    return product(x, norm.float().contiguous(), eps, turn)


def gated_projection(
    projection: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, norm: torch.Tensor, eps: float
) -> torch.Tensor:
    """silu(gate) * up, a Llama MLP's gated unit, from `normed_projection`'s outputs gate then up;
    on the node's kernels, in the same call."""
    product = _fusable(projection, x)
    if product is None:
        gate, up = normed_projection(projection, x, norm, eps).chunk(2, dim=-1)
        return F.silu(gate) * up
    return product(x, norm.float().contiguous(), eps, cpu_kernels.GATED)


def residual_projection(projection: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                        residual: torch.Tensor) -> torch.Tensor:
    """residual + projection(x); on the node's kernels, the sum taken in the same call, with the
    same bits."""
    product = _fusable(projection, x)
    if product is None or residual.dtype != torch.float32 or not residual.is_contiguous():
        return residual + projection(x)
    return product(x, then=cpu_kernels.Epilogue(residual=residual.data_ptr()))


def _fusable(projection: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> cpu_kernels.BoundWeight | None:
    """The projection's product on the node's kernels where what follows it may run in the same
    call: no bias to add first, and x already fp32 and contiguous."""
    return unbiased_product(projection) if x.dtype == torch.float32 and x.is_contiguous() else None


def unbiased_product(projection: Callable[[torch.Tensor], torch.Tensor]) -> cpu_kernels.BoundWeight | None:
    """The projection's product on the node's kernels where it has no bias, else None."""
    if not isinstance(projection, (Int4Linear, Int8Linear)) or projection.bias is not None:
        return None
    return projection.product


def _on_kernels(
    product: cpu_kernels.BoundWeight, x: torch.Tensor, bias: torch.Tensor | None,
    norm: torch.Tensor | None = None, eps: float = 0.0,
) -> torch.Tensor:
    """x [..., k] through a product on the node's kernels, back in x's dtype, plus the bias. A
    decode step makes over a hundred of these calls, so x goes in as it is wherever it can."""
    rows = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    return _in_x_dtype(product(rows, norm, eps), x, bias)


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's rows back in x's shape and dtype, plus the bias."""
    return _in_x_dtype(y.view(*x.shape[:-1], y.shape[-1]), x, bias)


def _in_x_dtype(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y in x's dtype, plus the bias."""
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if bias is None else y + bias


def _bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def int4_fits(shape: torch.Size | tuple[int, ...]) -> bool:
    rows, columns = shape
    return rows % INT4_ROW_TILE == 0 and columns % GROUP == 0


def int8_groups(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [rows, columns] and a scale per group of 32 along each row [rows,
    groups] in `scale_dtype`: w ≈ code * scale. A group whose largest code is ±127, as in a GGUF
    Q8_0 block, comes back exactly."""
    rows, columns = weight.shape
    codes, scale = int8_rows(weight.reshape(-1, GROUP), scale_dtype)
    return codes.view(rows, columns), scale.view(rows, columns // GROUP)


def int8_rows(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [rows, columns] and a scale per row in `scale_dtype`: w ≈ code * scale."""
    scale = _representable(weight.abs().amax(dim=1) / 127, scale_dtype)
    codes = torch.round(weight / scale[:, None].float()).clamp(-127, 127).to(torch.int8)
    return codes, scale


def int4_groups(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes 0..15 [rows, columns] with a scale and a minimum per group of 32 along each row
    [rows, groups] in `scale_dtype`: w ≈ code * scale + minimum. A group already on a 4-bit grid
    (a GGUF Q4_0, Q4_1 or Q4_K block's 32 weights, dequantized) keeps its codes: only its scale
    and minimum are rounded to `scale_dtype`."""
    rows, columns = weight.shape
    groups = weight.reshape(rows, columns // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    steps = grid_steps(groups, low, high)
    scale, low = _representable((high - low) / steps, scale_dtype), low.to(scale_dtype)
    codes = torch.round((groups - low[..., None].float()) / scale[..., None].float()).clamp(0, 15).to(torch.uint8)
    return codes.reshape(rows, columns), scale, low


def grid_steps(groups: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Per group [..., 32] of weights from `low` to `high`, the steps (1 to 15) of the grid
    low + k * (high - low) / steps every weight lies on, where they do; 15 elsewhere. The step
    is the smallest gap between the group's weights, so a group that uses no two neighbouring
    codes is re-rounded, as any group of float weights is."""
    width = high - low
    gaps = groups.sort(dim=-1).values.diff(dim=-1)
    gaps = gaps.masked_fill(gaps <= GRID_TOLERANCE * width[..., None], float("inf"))
    steps = (width / gaps.amin(dim=-1)).round().clamp(1, 15)
    position = (groups - low[..., None]) * (steps / width)[..., None]
    on_grid = ((position - position.round()).abs() <= GRID_TOLERANCE * 15).all(dim=-1)
    return torch.where(on_grid, steps, 15.0)


def _representable(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scales in `dtype`, none of them zero: at least the type's smallest positive value (only a
    group of equal weights comes that low, and its codes are then all the same)."""
    info = torch.finfo(dtype)
    return scale.to(dtype).clamp(min=info.smallest_normal * info.eps)


def held_format(fmt: WeightFormat, bits: int | None) -> WeightFormat:
    """The format a weight the checkpoint keeps in `bits` (None: float) is held in under `fmt`:
    under int4, one kept in more than 4 bits (a Q4_K_M file's Q6_K matrices) takes int8, the
    nearest format that keeps it."""
    return WeightFormat.INT8 if fmt == WeightFormat.INT4 and bits is not None and bits > 4 else fmt


def quantized_linear(fmt: WeightFormat, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """A projection in `fmt`; a shape the int4 kernel cannot tile takes int8, and one the int8
    kernel cannot take stays float."""
    if fmt == WeightFormat.INT4 and int4_fits(weight.shape):
        return Int4Linear(weight, bias)
    if weight.shape[1] % INT8_COLUMN_MULTIPLE == 0:
        return Int8Linear(weight, bias)
    return Linear(weight, bias)


class Int8Embedding:
    """The embedding table as int8 rows; a lookup dequantizes its rows. It reads the codes of an
    int8 lm_head, so a tied table is held once."""

    def __init__(self, table: Int8Linear, *, shared: bool):
        self.table = table
        self.nbytes = 0 if shared else table.nbytes

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.weight_rows(tokens.flatten()).view(*tokens.shape, self.table.in_features)
