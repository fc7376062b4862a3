"""SmolLM3: Llama's layer, every fourth layer without rotary positions (NoPE)."""

from __future__ import annotations

import dataclasses

from nodeagent.engine.families.base import Family, MetadataGetter
from nodeagent.engine.families.spec import DecoderSpec
from nodeagent.engine.model import ModelConfig

#: Hugging Face's default, and what llama.cpp's smollm3 graph hard-codes: layers 3, 7, 11, ...
NO_ROPE_INTERVAL = 4


class SmolLM3(Family):
    name = "smollm3"
    model_types = ("smollm3",)
    architectures = ("smollm3",)
    permuted_architectures = ("smollm3",)

    def spec_from_hf(self, raw: dict, config: ModelConfig) -> DecoderSpec:
        interval = int(raw.get("no_rope_layer_interval", NO_ROPE_INTERVAL))
        uses = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(config.n_layers)]
        return dataclasses.replace(super().spec_from_hf(raw, config), layer_ropes=self._ropes(config, uses))

    def spec_from_gguf(self, get: MetadataGetter, config: ModelConfig, tensors: dict) -> DecoderSpec:
        uses = [int((i + 1) % NO_ROPE_INTERVAL != 0) for i in range(config.n_layers)]
        return dataclasses.replace(super().spec_from_gguf(get, config, tensors), layer_ropes=self._ropes(config, uses))

    @staticmethod
    def _ropes(config: ModelConfig, uses: list[int]) -> tuple:
        return tuple(config.rope if use else None for use in uses)
