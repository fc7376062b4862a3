"""What every family shares: reading a Hugging Face `config.json` or GGUF metadata into a
`ModelConfig`, and the tensors under the engine's names. `Family` is Llama's; a family module
subclasses it where its config, its maths (`spec_from_hf`, `spec_from_gguf`) or its tensor
names differ, and `registry` finds it by `model_type` and by GGUF architecture.

The engine's names are Llama's Hugging Face names plus the norms Llama lacks:
`attn_out_norm` and `mlp_out_norm` after the attention and MLP outputs, `self_attn.q_norm` and
`self_attn.k_norm`; `post_attention_layernorm` always means the norm before the MLP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from nodeagent.daemon import ModelLoadError
from nodeagent.engine.families.spec import LLAMA, DecoderSpec, Rope, RopeFactors
from nodeagent.engine.model import ModelConfig, TensorSource
from nodeagent.engine.rope import RopeScalingError, inv_frequencies, scaling_type

REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)

#: Reads one `{arch}.KEY` GGUF metadata value: get(KEY, type, default) (no default: required).
MetadataGetter = Callable[..., Any]

#: GGUF layer-tensor names and the engine's, for what every Llama-shaped family writes.
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "attn_out_norm.weight",
    "post_ffw_norm.weight": "mlp_out_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class Family:
    """Llama, Mistral and Qwen2 (q/k/v biases): the decoder every other family varies."""

    name = "llama"
    #: Hugging Face `model_type`s and GGUF `general.architecture`s this family reads.
    model_types: tuple[str, ...] = ("llama", "mistral", "qwen2")
    architectures: tuple[str, ...] = ("llama", "qwen2")
    #: llama.cpp's converter permutes q/k rows for its rotary kernel in these architectures.
    permuted_architectures: tuple[str, ...] = ("llama",)
    #: Hugging Face activations this family's MLP computes.
    activations: tuple[str, ...] = ("silu", "swish")
    #: The engine's layer-tensor names that the family's Hugging Face checkpoints call otherwise.
    hf_names: dict[str, str] = {}
    #: What the family's layer always differs by (DecoderSpec fields), whatever its config says.
    spec_options: dict[str, Any] = {}
    #: Whether a config without `tie_word_embeddings` ties them (Gemma's do).
    tied_by_default = False

    # ---- Hugging Face ----------------------------------------------------------------------

    def config_from_hf(self, raw: dict, extra_eos: tuple[int, ...] = ()) -> ModelConfig:
        """The engine's config from a Hugging Face `config.json` of this family."""
        missing = [key for key in REQUIRED_KEYS if key not in raw]
        if missing:
            raise ModelLoadError(f"config.json lacks {', '.join(missing)}")
        self._check_mlp(raw)
        n_heads = int(raw["num_attention_heads"])
        rope = hf_rope(raw)
        config = ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            n_layers=int(raw["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // n_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", self.tied_by_default)),
            eos_token_ids=tuple(sorted(set(ids(raw.get("eos_token_id"))) | set(extra_eos))),
        )
        config = dataclasses.replace(config, spec=self.spec_from_hf(raw, config))
        check_config(config)
        return config

    def spec_from_hf(self, raw: dict, config: ModelConfig) -> DecoderSpec:
        return dataclasses.replace(LLAMA, family=self.name, layer_windows=hf_layer_windows(raw, config.n_layers),
                                   partial_rotary=partial_rotary(raw), **self.spec_options)

    def _check_mlp(self, raw: dict) -> None:
        """The MLP is gated by one of the family's activations, without biases."""
        act = raw.get("hidden_act", raw.get("hidden_activation", self.activations[0]))
        if act not in self.activations:
            raise ModelLoadError(
                f"config.json: hidden_act {act!r} is not supported (this engine's {self.name} MLP is "
                f"{'/'.join(self.activations)}-gated)"
            )
        if raw.get("mlp_bias"):
            raise ModelLoadError("config.json: mlp_bias true is not supported (MLP projections without biases only)")

    def hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A Hugging Face tensor as the engine holds it (Gemma's norms store w for 1 + w)."""
        return tensor

    # ---- GGUF ------------------------------------------------------------------------------

    def spec_from_gguf(self, get: MetadataGetter, config: ModelConfig, tensors: dict) -> DecoderSpec:
        window = config.sliding_window
        return dataclasses.replace(LLAMA, family=self.name,
                                   layer_windows=(window,) * config.n_layers if window else (), **self.spec_options)

    def gguf_rope_factors(self, get: MetadataGetter, vectors: dict[str, tuple[float, ...]]) -> RopeFactors | None:
        """The divisors llama.cpp's converter writes as `rope_freqs` for Llama 3.1's scaling, in
        place of any `rope_scaling` key. `vectors`: the file's rope tensors by name."""
        factors = vectors.get("rope_freqs.weight")
        return None if factors is None else RopeFactors(factors)

    def source(self, source: TensorSource, config: ModelConfig, hf: bool) -> TensorSource:
        """The checkpoint's tensors under the engine's names."""
        return FamilySource(source, self, hf)


class FamilySource:
    """A checkpoint's tensors under the engine's names: the family's own Hugging Face names
    looked up and its Hugging Face forms converted (`Family.hf_tensor`) where the source is a
    Hugging Face one."""

    def __init__(self, source: TensorSource, family: Family, hf: bool):
        self.source, self.family, self.hf = source, family, hf

    def _name(self, name: str) -> str:
        """The source's name for `name`: a Hugging Face checkpoint's own; a GGUF source already
        answers to the engine's names."""
        prefix, _, rest = name.partition(".layers.")
        if not rest or not self.hf:
            return name
        layer, _, suffix = rest.partition(".")
        return f"{prefix}.layers.{layer}.{self.family.hf_names.get(suffix, suffix)}"

    def has(self, name: str) -> bool:
        return self.source.has(self._name(name))

    def bits(self, name: str) -> int | None:
        return self.source.bits(self._name(name))

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.source.get(self._name(name), shape)
        return self.family.hf_tensor(name, tensor) if self.hf else tensor


def hf_rope(raw: dict, layer_type: str | None = None, default_theta: float = 10000.0) -> Rope:
    """The rotary positions a Hugging Face config gives (a layer type's own where the config
    has one per type): `rope_theta` and `rope_scaling` (older configs) or `rope_parameters`."""
    params = raw.get("rope_parameters") or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    scaling = raw.get("rope_scaling") if layer_type in (None, "full_attention") else None
    scaling = scaling or params
    theta = params.get("rope_theta") or raw.get("rope_theta") or default_theta
    if scaling_type(scaling) == "default":
        return Rope(float(theta))
    kept = dict(scaling)
    if "original_max_position_embeddings" in raw:  # Phi-3 keeps it beside the scaling
        kept.setdefault("original_max_position_embeddings", raw["original_max_position_embeddings"])
    return Rope(float(theta), kept)


def partial_rotary(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return float(raw.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)


def hf_layer_types(raw: dict, n_layers: int) -> list[str] | None:
    """`layer_types` as Hugging Face reads it: listed, or Qwen2's `max_window_layers` rule."""
    types = raw.get("layer_types")
    if types is None and raw.get("model_type") == "qwen2":
        first = int(raw.get("max_window_layers", 0))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return types


def hf_layer_windows(raw: dict, n_layers: int) -> tuple[int | None, ...]:
    """Each layer's window as Hugging Face reads the config: Mistral's `sliding_window` on every
    layer, or on the layers `layer_types` marks sliding; Qwen2's only with
    `use_sliding_window` (and any family's where that key says no). Llama ignores the key.
    Empty where no layer has one."""
    window = raw.get("sliding_window")
    model_type = raw.get("model_type", "llama")
    asked = raw.get("use_sliding_window", model_type != "qwen2")
    if not window or model_type == "llama" or not asked:
        return ()
    types = hf_layer_types(raw, n_layers)
    if types is None:
        return (int(window),) * n_layers
    if len(types) != n_layers:
        raise ModelLoadError(f"config.json: layer_types lists {len(types)} layers, not {n_layers}")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(windows) else ()


def gguf_rope_scaling(get: MetadataGetter) -> dict | None:
    kind = get("rope.scaling.type", str, "none")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": get("rope.scaling.factor", float, 1.0)}
    original = get("rope.scaling.original_context_length", int, 0)
    if original:
        scaling["original_max_position_embeddings"] = original
    return scaling


def check_config(c: ModelConfig, where: str = "config.json") -> None:
    """Shape and rope checks every checkpoint format needs before tensors are read."""
    if c.n_heads % c.n_kv_heads:
        raise ModelLoadError(
            f"{where}: num_attention_heads {c.n_heads} is not a multiple of "
            f"num_key_value_heads {c.n_kv_heads}"
        )
    ropes = {c.layer_rope(i) for i in range(c.n_layers)}
    for rope in filter(None, ropes):
        if rope.factors is not None:
            check_rope_factors(rope.factors, c.rotary_dim, where)
            continue
        try:
            inv_frequencies(c.rotary_dim, rope.theta, rope.scaling, c.max_position_embeddings,
                            c.max_position_embeddings)
        except RopeScalingError as e:
            raise ModelLoadError(f"{where}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{where}: rope_scaling {rope.scaling!r} is incomplete: {e!r}") from None


def check_rope_factors(factors: RopeFactors, rotary_dim: int, where: str) -> None:
    """A divisor for each rotary pair, short and long alike."""
    for vector in (factors.short, factors.long):
        if vector is not None and len(vector) * 2 != rotary_dim:
            raise ModelLoadError(f"{where}: rope divisors for {len(vector) * 2} rotary dimensions, not {rotary_dim}")


def ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]
