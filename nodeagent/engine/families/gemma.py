"""Gemma 2 and Gemma 3 (text): norms around both sides of each block with Gemma's (1 + w),
GeGLU with tanh, embeddings times sqrt(hidden_size), `query_pre_attn_scalar`, tied embeddings,
and sliding layers between global ones. Gemma 2 soft-caps attention scores and logits; Gemma 3
adds q/k norms per head and gives its sliding layers a rope base of their own."""

from __future__ import annotations

import math

import torch

from nodeagent.engine.families.base import Family, MetadataGetter, hf_layer_types, hf_rope
from nodeagent.engine.families.spec import Activation, DecoderSpec, Norms, QKNorm, Rope
from nodeagent.engine.model import ModelConfig

#: llama.cpp's reading of a Gemma 27B: its attention scales by the width a head would have,
#: not by query_pre_attn_scalar, which GGUF files do not carry (layer counts of Gemma 2 and 3).
GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


class Gemma2(Family):
    name = "gemma2"
    model_types = ("gemma2",)
    architectures = ("gemma2",)
    permuted_architectures = ()
    activations = ("gelu_pytorch_tanh", "gelu_tanh")
    tied_by_default = True
    spec_options = {"norms": Norms.SANDWICH, "activation": Activation.GELU_TANH}
    #: Sliding layers to global ones, as `layer_types` falls back to: 1 of 2 in Gemma 2.
    window_pattern = 2
    #: llama.cpp's gemma2 graph caps attention scores and logits always, at these where the file
    #: names no cap; its gemma3 graph never caps scores, and logits only where the file says.
    gguf_attn_softcap: float | None = 50.0
    gguf_final_softcap = 30.0
    hf_names = {
        "post_attention_layernorm.weight": "pre_feedforward_layernorm.weight",
        "attn_out_norm.weight": "post_attention_layernorm.weight",
        "mlp_out_norm.weight": "post_feedforward_layernorm.weight",
    }

    def spec_from_hf(self, raw: dict, config: ModelConfig) -> DecoderSpec:
        types = hf_layer_types(raw, config.n_layers) or self._pattern(config.n_layers)
        window = raw.get("sliding_window")
        scalar = float(raw.get("query_pre_attn_scalar", config.head_dim))
        return self._spec(
            config,
            windows=tuple(int(window) if window and t == "sliding_attention" else None for t in types),
            query_scale=math.sqrt(config.head_dim / scalar),
            attn_softcap=raw.get("attn_logit_softcapping"),
            final_softcap=raw.get("final_logit_softcapping"),
            ropes=self._hf_ropes(raw, types),
        )

    def spec_from_gguf(self, get: MetadataGetter, config: ModelConfig, tensors: dict) -> DecoderSpec:
        window = get("attention.sliding_window", int, 4096)
        types = self._gguf_layer_types(get, config.n_layers)
        width = config.hidden_size // config.n_heads
        big = config.n_layers == GGUF_27B_LAYERS[self.name]
        attn_softcap = self.gguf_attn_softcap
        return self._spec(
            config,
            windows=tuple(window if t == "sliding_attention" else None for t in types),
            query_scale=math.sqrt(config.head_dim / width) if big else 1.0,
            attn_softcap=None if attn_softcap is None else get("attn_logit_softcapping", float, attn_softcap),
            final_softcap=get("final_logit_softcapping", float, self.gguf_final_softcap) or None,
            ropes=self._gguf_ropes(get, config, types),
        )

    def _spec(self, config: ModelConfig, *, windows: tuple, query_scale: float, attn_softcap: float | None,
              final_softcap: float | None, ropes: tuple) -> DecoderSpec:
        return DecoderSpec(
            family=self.name,
            embed_scale=math.sqrt(config.hidden_size),
            query_scale=query_scale,
            attn_softcap=None if attn_softcap is None else float(attn_softcap),
            final_softcap=None if final_softcap is None else float(final_softcap),
            layer_windows=windows if any(windows) else (),
            layer_ropes=ropes,
            **self.spec_options,
        )

    def _pattern(self, n_layers: int, period: int | None = None) -> list[str]:
        """Every `period`-th layer global (default `window_pattern`), the others sliding."""
        every = period or self.window_pattern
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]

    def _gguf_layer_types(self, get: MetadataGetter, n_layers: int) -> list[str]:
        return self._pattern(n_layers)

    def _hf_ropes(self, raw: dict, types: list[str]) -> tuple:
        return ()

    def _gguf_ropes(self, get: MetadataGetter, config: ModelConfig, types: list[str]) -> tuple:
        return ()

    def hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Gemma's RMSNorms scale by (1 + w); the engine's by its weight, so it holds 1 + w, as
        llama.cpp's converter writes it."""
        return tensor + 1.0 if name.endswith("norm.weight") else tensor


class Gemma3(Gemma2):
    name = "gemma3"
    model_types = ("gemma3_text",)
    architectures = ("gemma3",)
    spec_options = {**Gemma2.spec_options, "qk_norm": QKNorm.HEAD}
    window_pattern = 6
    gguf_attn_softcap = None
    gguf_final_softcap = 0.0

    def _hf_ropes(self, raw: dict, types: list[str]) -> tuple:
        local_theta = float(raw.get("rope_local_base_freq", 10000.0))
        full = hf_rope(raw, "full_attention", 1_000_000.0)
        local = hf_rope(raw, "sliding_attention", local_theta)
        if not isinstance((raw.get("rope_parameters") or {}).get("sliding_attention"), dict):
            local = Rope(local_theta)
        return tuple(local if t == "sliding_attention" else full for t in types)

    def _gguf_ropes(self, get: MetadataGetter, config: ModelConfig, types: list[str]) -> tuple:
        local = Rope(get("rope.freq_base_swa", float, 10000.0))
        return tuple(local if t == "sliding_attention" else config.rope for t in types)

    def _gguf_layer_types(self, get: MetadataGetter, n_layers: int) -> list[str]:
        pattern = get("attention.sliding_window_pattern", object, self.window_pattern)
        if isinstance(pattern, list):
            return ["sliding_attention" if swa else "full_attention" for swa in pattern]
        return self._pattern(n_layers, int(pattern))
