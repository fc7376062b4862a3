"""Rotary positions: frequencies as Hugging Face computes them, so logits agree with it, applied
as one complex multiply on q/k rows reordered into pairs at load."""

from __future__ import annotations

import math

import torch

SUPPORTED_SCALING = ("default", "linear", "llama3")


class RopeScalingError(ValueError):
    """The checkpoint asks for a rope scaling this engine does not implement."""


def scaling_type(scaling: dict | None) -> str:
    """The scaling's type name; `rope_type` is the newer key, `type` the older one."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair rotation frequencies (fp32, [head_dim // 2]) after the checkpoint's scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = scaling_type(scaling)
    if kind == "default" or scaling is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
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


def rope_table(
    inv_freq: torch.Tensor, n_positions: int, device: torch.device
) -> torch.Tensor:
    """cos + i·sin of every position's angles, complex64 [n_positions, head_dim // 2]."""
    angles = torch.outer(torch.arange(n_positions, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(device)


def interleave_pairs(rows: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder q/k projection rows from Hugging Face's half-split rotary layout to pairs.

    HF rotates dimension j with j + head_dim/2; after this reordering the two sit side by side,
    so the rotation is one complex multiply. q and k are reordered alike, so q·k is unchanged.
    """
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    per_head = rows.reshape(n_heads, head_dim, *rows.shape[1:])
    return per_head[:, order].reshape(rows.shape)


def rotate_in_place(qk: torch.Tensor, freqs: torch.Tensor) -> None:
    """Rotate qk [..., heads, head_dim] (paired layout) by complex `freqs` [..., 1, head_dim/2]."""
    if qk.dtype == torch.float32:
        torch.view_as_complex(qk.view(qk.shape[:-1] + (-1, 2))).mul_(freqs)
        return
    rotated = torch.view_as_complex(qk.float().unflatten(-1, (-1, 2))) * freqs
    qk.copy_(torch.view_as_real(rotated).flatten(-2))
