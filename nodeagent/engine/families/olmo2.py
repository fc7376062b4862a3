"""OLMo 2: no norms before the blocks, an RMSNorm after each block's output, and q/k norms over
the whole projections."""

from __future__ import annotations

from nodeagent.engine.families.base import Family
from nodeagent.engine.families.spec import Norms, QKNorm


class Olmo2(Family):
    name = "olmo2"
    model_types = ("olmo2",)
    architectures = ("olmo2",)
    permuted_architectures = ()
    hf_names = {
        "attn_out_norm.weight": "post_attention_layernorm.weight",
        "mlp_out_norm.weight": "post_feedforward_layernorm.weight",
    }
    spec_options = {"norms": Norms.POST, "qk_norm": QKNorm.PROJECTION}
