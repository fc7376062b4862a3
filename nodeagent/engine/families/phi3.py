"""Phi-3 and Phi-4-mini: Llama's layer with q/k/v and gate/up each one fused tensor in the
checkpoint, longrope scaling and, on Phi-4-mini, rotary positions on part of each head."""

from __future__ import annotations

import dataclasses

import torch

from nodeagent.engine.families.base import Family, FamilySource, MetadataGetter
from nodeagent.engine.families.spec import DecoderSpec, RopeFactors
from nodeagent.engine.model import ModelConfig, TensorSource


class Phi3(Family):
    name = "phi3"
    model_types = ("phi3",)
    architectures = ("phi3",)
    permuted_architectures = ()

    def source(self, source: TensorSource, config: ModelConfig, hf: bool) -> TensorSource:
        return FusedSource(FamilySource(source, self, hf), config, "mlp.up_proj.weight" if not hf
                           else "mlp.gate_up_proj.weight")

    def spec_from_gguf(self, get: MetadataGetter, config: ModelConfig, tensors: dict) -> DecoderSpec:
        """llama.cpp's phi3 graph never slides its attention, whatever the file says."""
        rot = get("rope.dimension_count", int, config.head_dim)
        return dataclasses.replace(super().spec_from_gguf(get, config, tensors),
                                   layer_windows=(None,) * config.n_layers, partial_rotary=rot / config.head_dim)

    def gguf_rope_factors(self, get: MetadataGetter, vectors: dict[str, tuple[float, ...]]) -> RopeFactors | None:
        """Phi-3's longrope as llama.cpp holds it: the short and long factors as tensors and the
        attention factor as a key."""
        if "rope_factors_short.weight" not in vectors:
            return None
        return RopeFactors(vectors["rope_factors_short.weight"], vectors.get("rope_factors_long.weight"),
                           get("rope.scaling.original_context_length", int, 0),
                           get("rope.scaling.attn_factor", float, 1.0))


class FusedSource:
    """Phi-3's fused qkv and gate_up tensors, handed out as the q, k, v, gate and up the engine
    reads (the fused tensor read once for all its parts)."""

    def __init__(self, source: FamilySource, config: ModelConfig, gate_up: str):
        self.source, self.config = source, config
        q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        ff = config.intermediate_size
        self._parts = {
            "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0, q, q + 2 * kv),
            "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", q, kv, q + 2 * kv),
            "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", q + kv, kv, q + 2 * kv),
            "mlp.gate_proj.weight": (gate_up, 0, ff, 2 * ff),
            "mlp.up_proj.weight": (gate_up, ff, ff, 2 * ff),
        }
        self._held: tuple[str, torch.Tensor] | None = None

    def has(self, name: str) -> bool:
        part = self._part(name)
        return self.source.has(name if part is None else part[0])

    def bits(self, name: str) -> int | None:
        part = self._part(name)
        return self.source.bits(name if part is None else part[0])

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        part = self._part(name)
        if part is None:
            return self.source.get(name, shape)
        fused, start, rows, total = part
        if self._held is None or self._held[0] != fused:
            self._held = (fused, self.source.get(fused, (total, *shape[1:])))
        return self._held[1].narrow(0, start, rows).clone()

    def _part(self, name: str) -> tuple[str, int, int, int] | None:
        prefix, _, suffix = name.rpartition(".layers.")
        layer, _, rest = suffix.partition(".")
        if rest not in self._parts:
            return None
        fused, start, rows, total = self._parts[rest]
        return f"{prefix}.layers.{layer}.{fused}", start, rows, total
