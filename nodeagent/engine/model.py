"""A Llama-family decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

The weights are held fused (q/k/v as one matrix, gate/up as one) so a decode step costs few
kernel launches; attention is a callback so the same layers serve the paged KV pool of the
scheduler and the cache-free stage forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from nodeagent.engine.rope import apply_rope, inv_frequencies, rope_tables


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a checkpoint, in the engine's own names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()


class TensorSource(Protocol):
    """Named checkpoint tensors (Hugging Face names), checked against the shape asked for."""

    def has(self, name: str) -> bool: ...

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor: ...


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


#: attend(layer, q [B,C,H,hd], k [B,C,KV,hd], v [B,C,KV,hd]) -> [B,C,H*hd]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LlamaModel:
    """The decoder's weights and the pieces of its forward pass."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
    ):
        self.config = config
        self.embed_weight = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self._qk_width = (config.n_heads + config.n_kv_heads) * config.head_dim
        self.set_context(min(config.max_position_embeddings, 2048))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @classmethod
    def from_source(
        cls, config: ModelConfig, source: TensorSource, dtype: torch.dtype, device: torch.device
    ) -> "LlamaModel":
        """Build from Hugging Face-named tensors, fusing q/k/v and gate/up on the way."""

        def take(name: str, *shape: int) -> torch.Tensor:
            return source.get(name, shape).to(dtype=dtype, device=device)

        c = config
        embed = take("model.embed_tokens.weight", c.vocab_size, c.hidden_size)
        layers = [_layer_weights(c, source, i, take) for i in range(c.n_layers)]
        norm = take("model.norm.weight", c.hidden_size)
        if c.tie_word_embeddings:
            lm_head = embed
        else:
            lm_head = take("lm_head.weight", c.vocab_size, c.hidden_size)
        return cls(config, embed, layers, norm, lm_head)

    def set_context(self, n_positions: int) -> None:
        """Size the rotary tables for positions 0..n_positions-1."""
        self.context = n_positions
        self._cos, self._sin = rope_tables(self.inv_freq, n_positions, self.dtype, self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, 1, hd] for `positions`, ready to broadcast over heads."""
        return self._cos[positions].unsqueeze(-2), self._sin[positions].unsqueeze(-2)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_weight)

    def layer(
        self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """One decoder layer on x [B,C,D]; cos/sin [B,C,1,hd] for the positions of x."""
        c, w = self.config, self.layers[index]
        batch, chunk = x.shape[:2]
        h = F.rms_norm(x, (c.hidden_size,), w.input_norm, c.rms_norm_eps)
        qkv = F.linear(h, w.qkv, w.qkv_bias)
        qk = qkv[..., : self._qk_width].view(batch, chunk, c.n_heads + c.n_kv_heads, c.head_dim)
        qk = apply_rope(qk, cos, sin)
        v = qkv[..., self._qk_width :].view(batch, chunk, c.n_kv_heads, c.head_dim)
        attn = attend(index, qk[:, :, : c.n_heads], qk[:, :, c.n_heads :], v)
        x = x + F.linear(attn, w.o, w.o_bias)
        h = F.rms_norm(x, (c.hidden_size,), w.post_norm, c.rms_norm_eps)
        gate, up = F.linear(h, w.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w.down)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head, in fp32 so sampling and argmax see full precision."""
        h = F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        return F.linear(h, self.lm_head).float()

    def run_causal(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Layers [start, end) over x [1,N,D] at positions 0..N-1, with no KV cache."""
        n = x.shape[1]
        cos, sin = self.rope(torch.arange(n, device=self.device).unsqueeze(0))
        mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()[None, None]

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return grouped_attention(q, k.transpose(1, 2), v.transpose(1, 2), mask)

        for index in range(start, end):
            x = self.layer(index, x, cos, sin, attend)
        return x


def _layer_weights(
    c: ModelConfig, source: TensorSource, i: int, take: Callable[..., torch.Tensor]
) -> LayerWeights:
    p = f"model.layers.{i}."
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    attn = p + "self_attn."
    qkv = torch.cat(
        [
            take(attn + "q_proj.weight", q_rows, c.hidden_size),
            take(attn + "k_proj.weight", kv_rows, c.hidden_size),
            take(attn + "v_proj.weight", kv_rows, c.hidden_size),
        ]
    )
    qkv_bias = None
    if source.has("model.layers.0.self_attn.q_proj.bias"):
        qkv_bias = torch.cat(
            [
                take(attn + "q_proj.bias", q_rows),
                take(attn + "k_proj.bias", kv_rows),
                take(attn + "v_proj.bias", kv_rows),
            ]
        )
    o_bias = None
    if source.has("model.layers.0.self_attn.o_proj.bias"):
        o_bias = take(attn + "o_proj.bias", c.hidden_size)
    gate_up = torch.cat(
        [
            take(p + "mlp.gate_proj.weight", c.intermediate_size, c.hidden_size),
            take(p + "mlp.up_proj.weight", c.intermediate_size, c.hidden_size),
        ]
    )
    return LayerWeights(
        input_norm=take(p + "input_layernorm.weight", c.hidden_size),
        qkv=qkv,
        qkv_bias=qkv_bias,
        o=take(attn + "o_proj.weight", c.hidden_size, q_rows),
        o_bias=o_bias,
        post_norm=take(p + "post_attention_layernorm.weight", c.hidden_size),
        gate_up=gate_up,
        down=take(p + "mlp.down_proj.weight", c.hidden_size, c.intermediate_size),
    )


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Grouped-query attention without copying K/V per query head.

    q [B,C,H,hd]; k, v [B,KV,T,hd]; mask [B,1,C,T] bool (True = attend). The G = H/KV query
    heads that share a K/V head are folded into the query axis, so one SDPA call covers them.
    Returns [B,C,H*hd].
    """
    batch, chunk, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    qg = q.reshape(batch, chunk, n_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, n_kv, group * chunk, head_dim)
    if chunk > 1:
        mask = mask.unsqueeze(2).expand(batch, 1, group, chunk, mask.shape[-1])
        mask = mask.reshape(batch, 1, group * chunk, -1)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    out = out.view(batch, n_kv, group, chunk, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, chunk, n_heads * head_dim)
