"""Projections `x @ W.T + b` with W kept in the layout its device multiplies fastest.

On CPU (fp32) the weight is pre-packed for oneDNN, which runs the few-row matmuls of batched
decode faster than the MKL path of `F.linear`, and single-row decode no slower. Elsewhere
(CUDA, or a torch without oneDNN) `F.linear` is the fast path.

A packed weight is opaque (no row can be read back), so a tied lm_head, which is also the
embedding table, is not packed: one copy serves both, laid out by `tied_layout`.

oneDNN builds a primitive for every input row count and weight shape it meets (0.5-2 MB each,
mostly generated code) and keeps it in its primitive cache and in ideep's per-thread cache,
1024 entries apiece by default, so prefill chunks of ever new sizes grew a node's memory for as
long as it ran. A packed projection therefore pads its rows to one of a few sizes
(`padded_rows`), and `bound_kernel_caches` caps both caches: a size met again after its entry
was dropped costs a rebuild of under a millisecond a weight shape.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

#: The batch size oneDNN lays the packed weight out for; any row count works with it.
PACKED_FOR_ROWS = 8
#: Row counts up to this run as they are (a decode step's lanes); larger ones are padded.
EXACT_ROWS = 8
#: Padded row counts per doubling, a power of two: each pads by less than a quarter.
SIZES_PER_DOUBLING = 4
#: Entries each oneDNN cache keeps: a decode step's weight shapes at every lane count up to 8,
#: and the prefill sizes in use beside them.
KERNEL_CACHE_ENTRIES = 64


def padded_rows(rows: int) -> int:
    """The row count a packed projection runs `rows` rows at: `rows` up to `EXACT_ROWS`, past
    it the next of `SIZES_PER_DOUBLING` evenly spaced sizes in each doubling (9 to 16 rows run
    at 10, 12, 14 or 16), so 32 sizes cover every prefill chunk up to 512 rows."""
    if rows <= EXACT_ROWS:
        return rows
    step = max((1 << (rows.bit_length() - 1)) // SIZES_PER_DOUBLING, 1)
    return -(-rows // step) * step


def bound_kernel_caches() -> None:
    """Cap oneDNN's primitive cache and ideep's at `KERNEL_CACHE_ENTRIES`, unless the operator
    set them. Both read their variable once, at the first primitive, so this runs before a
    model loads; an entry lives until both caches have dropped it."""
    for variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(variable, str(KERNEL_CACHE_ENTRIES))


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and onednn_linear_works()


@functools.cache
def onednn_linear_works() -> bool:
    """Whether this torch runs the private oneDNN ops the packed path uses, with the result
    `F.linear` gives: they are no public API, so a torch without them falls back to `F.linear`
    rather than failing at the first forward."""
    if not torch.backends.mkldnn.is_available():
        return False
    weight, x = torch.arange(6.0).reshape(2, 3), torch.ones(1, 3)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")
    except (AttributeError, RuntimeError, TypeError):
        return False
    return torch.equal(y, F.linear(x, weight))


def tied_layout(embed: torch.Tensor) -> torch.Tensor:
    """The embedding table [vocab, hidden] as the tied lm_head multiplies it fastest unpacked.

    Where weights are otherwise packed (CPU fp32), column-major: `F.linear` then runs MKL's
    plain x @ Wᵀ kernel, near the packed speed and several times the row-major one for few
    rows; an embedding lookup gathers the same values either way.
    """
    if can_pack(embed.device, embed.dtype):
        return embed.t().contiguous().t()
    return embed


class Linear:
    """One projection. `weight` is [out, in] as checkpoints store it; `pack=False` keeps it as
    given, for a weight that must stay readable (a tied lm_head)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = pack and can_pack(weight.device, weight.dtype)
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        padded = padded_rows(rows)
        if padded == rows:
            return self._packed(x)
        flat = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, padded - rows))
        return self._packed(flat)[:rows].view(*x.shape[:-1], self.out_features)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")

    @property
    def nbytes(self) -> int:
        numel = self.out_features * self.in_features + (0 if self.bias is None else self.bias.numel())
        return numel * self.weight.element_size()
