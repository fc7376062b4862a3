"""Qwen3: Llama's layer with an RMSNorm on each query and key head before the rotation."""

from __future__ import annotations

import dataclasses

from nodeagent.engine.families.base import Family, MetadataGetter
from nodeagent.engine.families.spec import DecoderSpec, QKNorm
from nodeagent.engine.model import ModelConfig


class Qwen3(Family):
    name = "qwen3"
    model_types = ("qwen3",)
    architectures = ("qwen3",)
    permuted_architectures = ()

    def spec_from_hf(self, raw: dict, config: ModelConfig) -> DecoderSpec:
        return dataclasses.replace(super().spec_from_hf(raw, config), qk_norm=QKNorm.HEAD)

    def spec_from_gguf(self, get: MetadataGetter, config: ModelConfig, tensors: dict) -> DecoderSpec:
        return dataclasses.replace(super().spec_from_gguf(get, config, tensors), qk_norm=QKNorm.HEAD)
