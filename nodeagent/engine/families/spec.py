"""What a decoder family computes beyond Llama's layer, as data the one forward reads.

A family module fills a `DecoderSpec` from its config once, at load; the model's layer and the
scheduler's attention read it and never ask which family they run. Scalars that only scale a
weight (Granite's residual and attention multipliers, a query pre-scale) are folded into the
weight at load, so they cost nothing per step and keep the fast paths open.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Norms(Enum):
    """Where a layer's RMSNorms sit around its attention and MLP blocks."""

    #: Before each block (Llama): x + block(norm(x)).
    PRE = "pre"
    #: After each block's output (OLMo 2): x + norm(block(x)).
    POST = "post"
    #: Both (Gemma 2 and 3): x + norm(block(norm(x))).
    SANDWICH = "sandwich"


class QKNorm(Enum):
    """An RMSNorm on the queries and keys before their rotation."""

    NONE = "none"
    #: Over each head's head_dim values (Qwen3, Gemma 3).
    HEAD = "head"
    #: Over the whole q and k projections (OLMo 2).
    PROJECTION = "projection"


class Activation(Enum):
    """The gate of the MLP's gated unit: act(gate) * up."""

    SILU = "silu"
    GELU_TANH = "gelu_tanh"


@dataclass(frozen=True)
class RopeFactors:
    """Per-frequency divisors as a GGUF file holds a scaling (llama.cpp's `rope_freqs` for Llama
    3.1, Phi-3's short and long factors), with the factor cos and sin are scaled by."""

    short: tuple[float, ...]
    #: Taken in place of `short` for a context past `original_context`, as llama.cpp does.
    long: tuple[float, ...] | None = None
    original_context: int = 0
    attention_factor: float = 1.0

    def pick(self, context: int) -> tuple[float, ...]:
        return self.long if self.long is not None and context > self.original_context else self.short


@dataclass(frozen=True)
class Rope:
    """Rotary positions: the base and a Hugging Face-style scaling (None: plain), or the
    divisors a GGUF file gives in place of the scaling."""

    theta: float = 10000.0
    scaling: dict | None = field(default=None, hash=False)
    factors: RopeFactors | None = None


@dataclass(frozen=True)
class DecoderSpec:
    """A family's maths, read once at load. The defaults are Llama's."""

    family: str = "llama"
    norms: Norms = Norms.PRE
    qk_norm: QKNorm = QKNorm.NONE
    activation: Activation = Activation.SILU
    #: Multiplies the token embeddings (Gemma: sqrt(hidden_size); Granite: embedding_multiplier).
    embed_scale: float = 1.0
    #: Multiplies the final logits (Granite: 1 / logits_scaling).
    logit_scale: float = 1.0
    #: The attention scale over head_dim ** -0.5 (Gemma's query_pre_attn_scalar, Granite's
    #: attention_multiplier), folded into q's weights, or its norm, at load.
    query_scale: float = 1.0
    #: Multiplies each block's output before the residual sum (Granite's residual_multiplier),
    #: folded into o and down at load.
    residual_scale: float = 1.0
    #: tanh soft-capping of attention scores and of the final logits (Gemma 2).
    attn_softcap: float | None = None
    final_softcap: float | None = None
    #: Each layer's attention window (None: full); empty means every layer takes the config's.
    layer_windows: tuple[int | None, ...] = ()
    #: Each layer's rotary positions (None: no rotation, SmolLM3's NoPE layers); empty means
    #: every layer takes the config's.
    layer_ropes: tuple[Rope | None, ...] = field(default=(), hash=False)
    #: The share of each head's dimensions rotated (Phi-4-mini: 0.75).
    partial_rotary: float = 1.0

    def plain(self) -> bool:
        """Llama's layer: pre-norms, no q/k norm, SwiGLU, one rope turning whole heads, no
        per-layer windows or caps. Only such a layer runs on the kernels' layer stack."""
        return (
            self.norms is Norms.PRE
            and self.qk_norm is QKNorm.NONE
            and self.activation is Activation.SILU
            and self.attn_softcap is None
            and self.partial_rotary == 1.0
            and len(set(self.layer_windows)) <= 1
            and len(set(self.layer_ropes)) <= 1
            and None not in self.layer_ropes
        )

    def why_not_plain(self) -> str:
        """What keeps this family off the layer stack, for the serving line."""
        reasons = [
            (self.norms is not Norms.PRE, f"{self.norms.value}-norm blocks"),
            (self.qk_norm is not QKNorm.NONE, "q/k norms"),
            (self.activation is not Activation.SILU, f"{self.activation.value} MLP"),
            (self.attn_softcap is not None, "attention soft-capping"),
            (self.partial_rotary != 1.0, "partial rotary"),
            (len(set(self.layer_windows)) > 1, "per-layer windows"),
            (len(set(self.layer_ropes)) > 1 or None in self.layer_ropes, "per-layer rope"),
        ]
        return ", ".join(text for hit, text in reasons if hit)


LLAMA = DecoderSpec()
