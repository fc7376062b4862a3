"""Qwen3: Llama's layer with an RMSNorm on each query and key head before the rotation."""

from __future__ import annotations

from nodeagent.engine.families.base import Family
from nodeagent.engine.families.spec import QKNorm


class Qwen3(Family):
    name = "qwen3"
    model_types = ("qwen3",)
    architectures = ("qwen3",)
    permuted_architectures = ()
    spec_options = {"qk_norm": QKNorm.HEAD}
