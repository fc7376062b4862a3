"""OLMo 2: no norms before the blocks, an RMSNorm after each block's output, and q/k norms over
the whole projections."""

from __future__ import annotations

import dataclasses

from nodeagent.engine.families.base import Family, MetadataGetter
from nodeagent.engine.families.spec import DecoderSpec, Norms, QKNorm
from nodeagent.engine.model import ModelConfig


class Olmo2(Family):
    name = "olmo2"
    model_types = ("olmo2",)
    architectures = ("olmo2",)
    permuted_architectures = ()
    hf_names = {
        "attn_out_norm.weight": "post_attention_layernorm.weight",
        "mlp_out_norm.weight": "post_feedforward_layernorm.weight",
    }

    def spec_from_hf(self, raw: dict, config: ModelConfig) -> DecoderSpec:
        return dataclasses.replace(super().spec_from_hf(raw, config), norms=Norms.POST, qk_norm=QKNorm.PROJECTION)

    def spec_from_gguf(self, get: MetadataGetter, config: ModelConfig, tensors: dict) -> DecoderSpec:
        return dataclasses.replace(super().spec_from_gguf(get, config, tensors), norms=Norms.POST,
                                   qk_norm=QKNorm.PROJECTION)
