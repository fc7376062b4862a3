"""Granite 3: Llama's layer with an embedding multiplier, a residual multiplier on each block's
output, its own attention scale and logits divided by `logits_scaling`."""

from __future__ import annotations

import dataclasses
import math

from nodeagent.engine.families.base import Family, MetadataGetter
from nodeagent.engine.families.spec import DecoderSpec
from nodeagent.engine.model import ModelConfig


class Granite(Family):
    name = "granite"
    model_types = ("granite",)
    architectures = ("granite",)
    permuted_architectures = ("granite",)

    def spec_from_hf(self, raw: dict, config: ModelConfig) -> DecoderSpec:
        return dataclasses.replace(
            super().spec_from_hf(raw, config),
            embed_scale=float(raw.get("embedding_multiplier", 1.0)),
            residual_scale=float(raw.get("residual_multiplier", 1.0)),
            query_scale=float(raw.get("attention_multiplier", config.head_dim**-0.5)) * math.sqrt(config.head_dim),
            logit_scale=1.0 / float(raw.get("logits_scaling", 1.0)),
        )

    def spec_from_gguf(self, get: MetadataGetter, config: ModelConfig, tensors: dict) -> DecoderSpec:
        return dataclasses.replace(
            super().spec_from_gguf(get, config, tensors),
            embed_scale=get("embedding_scale", float, 1.0),
            residual_scale=get("residual_scale", float, 1.0),
            query_scale=get("attention.scale", float, config.head_dim**-0.5) * math.sqrt(config.head_dim),
            logit_scale=1.0 / get("logit_scale", float),
        )
