"""Rotary positions: frequencies as Hugging Face computes them, so logits agree with it, applied
as one complex multiply on q/k rows reordered into pairs at load."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_SCALING = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


class RopeScalingError(ValueError):
    """The checkpoint asks for a rope scaling this engine does not implement."""


@dataclass(frozen=True)
class Frequencies:
    """Per-pair rotation frequencies (fp32, [dim // 2]) and the factor the rotation's cos and
    sin are scaled by (YaRN's and longrope's attention factor; 1 elsewhere)."""

    inv_freq: torch.Tensor
    attention_factor: float = 1.0


def scaling_type(scaling: dict | None) -> str:
    """The scaling's type name; `rope_type` is the newer key, `type` the older one."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def inv_frequencies(dim: int, theta: float, scaling: dict | None, context: int = 0,
                    trained: int = 2048) -> Frequencies:
    """Frequencies for rotating `dim` dimensions after the checkpoint's scaling, as Hugging Face
    computes them. `context` is the longest sequence the node serves and `trained` the
    checkpoint's `max_position_embeddings`: longrope takes its long factors, and dynamic NTK
    its larger base, only for a context past them, as Hugging Face does for such a sequence."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    kind = scaling_type(scaling)
    if kind == "default" or scaling is None:
        return Frequencies(inv_freq)
    if kind == "linear":
        return Frequencies(inv_freq / float(scaling["factor"]))
    if kind == "llama3":
        return Frequencies(_llama3(inv_freq, scaling))
    if kind == "yarn":
        return _yarn(dim, theta, scaling, trained)
    if kind == "longrope":
        return _longrope(exponents, theta, scaling, context, trained)
    if kind == "dynamic":
        return Frequencies(_dynamic(dim, theta, scaling, context, trained))
    raise RopeScalingError(
        f"unsupported rope_scaling type {kind!r} (supported: {', '.join(SUPPORTED_SCALING)})"
    )


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths slowed by `factor`, short kept, the middle blended."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: dict, trained: int) -> Frequencies:
    """YaRN: frequencies blended between interpolated and kept along a ramp over the pairs, and
    cos/sin scaled by an attention factor."""
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or trained / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
        else:
            attention = _yarn_mscale(factor)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept
    return Frequencies(inv_freq, float(attention))


def _longrope(exponents: torch.Tensor, theta: float, scaling: dict, context: int, trained: int) -> Frequencies:
    """Phi-3's longrope: per-pair divisors, the long ones only past the original context."""
    original = int(scaling.get("original_max_position_embeddings") or trained)
    factor = float(scaling.get("factor") or trained / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if context > original else "short_factor"
    divisors = torch.tensor(scaling[key], dtype=torch.float32)
    return Frequencies(1.0 / (divisors * theta**exponents), float(attention))


def _dynamic(dim: int, theta: float, scaling: dict, context: int, trained: int) -> torch.Tensor:
    """Dynamic NTK: the base grown for a context past the trained one (plain within it)."""
    factor = float(scaling["factor"])
    length = max(context, trained)
    base = theta * ((factor * length / trained) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_table(frequencies: Frequencies, n_positions: int, device: torch.device) -> torch.Tensor:
    """(cos + i·sin) times the attention factor for every position's angles, complex64
    [n_positions, dim // 2]."""
    angles = torch.outer(torch.arange(n_positions, dtype=torch.float32), frequencies.inv_freq)
    return torch.polar(torch.full_like(angles, frequencies.attention_factor), angles).to(device)


def pair_order(head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """The order `interleave_pairs` puts each head's dimensions in: the first `rotary_dim`
    (default all) as rotary pairs, the rest as they are."""
    rotary = head_dim if rotary_dim is None else rotary_dim
    half = rotary // 2
    pairs = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    return torch.cat([pairs, torch.arange(rotary, head_dim)])


def interleave_pairs(rows: torch.Tensor, n_heads: int, head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """Reorder q/k projection rows from Hugging Face's half-split rotary layout to pairs.

    HF rotates dimension j with j + rotary_dim/2; after this reordering the two sit side by
    side, so the rotation is one complex multiply. q and k are reordered alike, so q·k is
    unchanged; dimensions past `rotary_dim` are not rotated and keep their places.
    """
    order = pair_order(head_dim, rotary_dim)
    per_head = rows.reshape(n_heads, head_dim, *rows.shape[1:])
    return per_head[:, order].reshape(rows.shape)


def rotate_in_place(qk: torch.Tensor, freqs: torch.Tensor) -> None:
    """Rotate qk [..., heads, head_dim] (paired layout) by complex `freqs` [..., 1, head_dim/2]."""
    if qk.dtype == torch.float32:
        torch.view_as_complex(qk.view(qk.shape[:-1] + (-1, 2))).mul_(freqs)
        return
    rotated = torch.view_as_complex(qk.float().unflatten(-1, (-1, 2))) * freqs
    qk.copy_(torch.view_as_real(rotated).flatten(-2))
