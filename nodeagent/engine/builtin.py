"""The embedded default model: Llama-shaped, ~18M parameters, built from a fixed seed.

It needs no download, so `make run` and the tests serve a real torch decoder anywhere. Its
weights are random: the tokens it produces are meaningless but deterministic.
"""

from __future__ import annotations

import torch

from nodeagent.engine.choices import WeightFormat
from nodeagent.engine.loader import checked
from nodeagent.engine.model import LlamaModel, ModelConfig
from nodeagent.engine.shard import Shard, sharded

BUILTIN_NAME = "builtin"
CPU = torch.device("cpu")
BUILTIN_SEED = 20240611
BUILTIN_CONFIG = ModelConfig(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=1024,
    n_layers=10,
    n_heads=8,
    n_kv_heads=4,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    eos_token_ids=(2,),
)


class DictSource:
    """Hugging Face-named tensors held in memory (the builtin model, tests, the bench)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return checked(name, self.tensors[name], shape)

    def bits(self, name: str) -> int | None:
        return None


def random_tensors(
    config: ModelConfig, seed: int, std: float = 0.02, qkv_bias: bool = False
) -> dict[str, torch.Tensor]:
    """Hugging Face-named fp32 weights drawn from N(0, std), norms around 1."""
    g = torch.Generator().manual_seed(seed)
    c = config

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(c.hidden_size, generator=g)

    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    tensors = {"model.embed_tokens.weight": normal(c.vocab_size, c.hidden_size)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm_weight()
        tensors[p + "self_attn.q_proj.weight"] = normal(q_rows, c.hidden_size)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_rows, c.hidden_size)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_rows, c.hidden_size)
        tensors[p + "self_attn.o_proj.weight"] = normal(c.hidden_size, q_rows)
        if qkv_bias:
            tensors[p + "self_attn.q_proj.bias"] = normal(q_rows)
            tensors[p + "self_attn.k_proj.bias"] = normal(kv_rows)
            tensors[p + "self_attn.v_proj.bias"] = normal(kv_rows)
        tensors[p + "post_attention_layernorm.weight"] = norm_weight()
        tensors[p + "mlp.gate_proj.weight"] = normal(c.intermediate_size, c.hidden_size)
        tensors[p + "mlp.up_proj.weight"] = normal(c.intermediate_size, c.hidden_size)
        tensors[p + "mlp.down_proj.weight"] = normal(c.hidden_size, c.intermediate_size)
    tensors["model.norm.weight"] = norm_weight()
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(c.vocab_size, c.hidden_size)
    return tensors


def random_model(
    config: ModelConfig,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
    weights: WeightFormat = WeightFormat.FLOAT,
    **kwargs,
) -> LlamaModel:
    """A model of `config` with `random_tensors(config, seed, **kwargs)` as its weights."""
    tensors = random_tensors(config, seed, **kwargs)
    return LlamaModel.from_source(config, DictSource(tensors), dtype, device, weights)


def builtin_model(
    dtype: torch.dtype,
    device: torch.device,
    weights: WeightFormat = WeightFormat.FLOAT,
    shard: Shard | None = None,
) -> LlamaModel:
    """The embedded default model (`shard`'s share of it), the same on every start."""
    config, source = sharded(BUILTIN_CONFIG, DictSource(random_tensors(BUILTIN_CONFIG, BUILTIN_SEED)), shard, "builtin")
    return LlamaModel.from_source(config, source, dtype, device, weights)
