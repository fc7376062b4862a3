"""A Llama-family decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

Weights are held the way decode is fastest, not the way checkpoints store them: fused (q/k/v
as one projection, gate/up as one), in the device's fastest matmul layout (`Linear`) or kept
quantized (`quant`), and q/k rows reordered so rotary positions are one complex multiply.
Attention is a callback so the same layers serve the scheduler's paged KV pool and the
cache-free stage forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from nodeagent.engine.choices import WeightFormat
from nodeagent.engine.cpu_kernels import LayerStack, StackLayer, StackShape, attending_kernels, cpu_kernels
from nodeagent.engine.kvpool import CausalLane
from nodeagent.engine.linear import Linear, tied_layout
from nodeagent.engine.quant import (
    Int4Linear,
    Int8Embedding,
    Int8Head,
    Int8Linear,
    gated_projection,
    quantized_linear,
    residual_projection,
    rotated_projection,
    unbiased_product,
)
from nodeagent.engine.rope import interleave_pairs, inv_frequencies, rope_table

#: Rows a cache-free pass (`run_causal`) runs through a layer at once on the layer stack: a
#: prefill chunk's worth, whose rows' buffers stay in cache.
CAUSAL_CHUNK = 512


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
    #: Mistral-style local attention: a position sees itself and the window - 1 before it.
    sliding_window: int | None = None


class TensorSource(Protocol):
    """Named checkpoint tensors (Hugging Face names), checked against the shape asked for."""

    def has(self, name: str) -> bool: ...

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor: ...


class Projection(Protocol):
    """`x @ W.T + b` over the last axis of x, W held in some format."""

    @property
    def nbytes(self) -> int: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


#: Builds a projection from a float weight [out, in] and an optional bias.
MakeProjection = Callable[[torch.Tensor, torch.Tensor | None], Projection]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection


#: attend(layer, q [B,C,H,hd], kv [B,C,2,KV,hd]) -> [B,C,H*hd]
Attend = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class LlamaModel:
    """The decoder's weights and the pieces of its forward pass."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor | Int8Embedding,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: Projection,
        weights: WeightFormat = WeightFormat.FLOAT,
    ):
        self.config = config
        self.embedding = embed
        self.weights = weights
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self._q_width = config.n_heads * config.head_dim
        self._qk_width = (config.n_heads + config.n_kv_heads) * config.head_dim
        self._kv_width = 2 * config.n_kv_heads * config.head_dim
        #: Under tensor parallelism, sums the ranks' partial o and down outputs (an all-reduce).
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._stack = _layer_stack(config, layers) if self.dtype == torch.float32 else None
        self.set_context(min(config.max_position_embeddings, 2048))
        #: What the node's KV pool holds (`TorchDaemon` sets it), so that a cache-free pass
        #: (`run_causal`) stores its keys and values as a step stores them.
        self.kv_dtype = self.dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @classmethod
    def from_source(
        cls,
        config: ModelConfig,
        source: TensorSource,
        dtype: torch.dtype,
        device: torch.device,
        weights: WeightFormat = WeightFormat.FLOAT,
    ) -> LlamaModel:
        """Build from Hugging Face-named tensors, fusing and reordering on the way; `weights`
        (float, int8 or int4) is how the projections, the embedding and the lm_head are held."""

        def take(name: str, *shape: int) -> torch.Tensor:
            return source.get(name, shape).to(dtype=dtype, device=device)

        c = config
        make = _projection_maker(weights)
        layers = [_layer_weights(c, source, i, take, make) for i in range(c.n_layers)]
        norm = take("model.norm.weight", c.hidden_size)
        embed = take("model.embed_tokens.weight", c.vocab_size, c.hidden_size)
        tied = c.tie_word_embeddings
        if weights != WeightFormat.FLOAT:
            head = Int8Head(embed if tied else take("lm_head.weight", c.vocab_size, c.hidden_size))
            table = head if tied else Int8Linear(embed)
            return cls(config, Int8Embedding(table, shared=tied), layers, norm, head, weights)
        if tied:
            embed = tied_layout(embed)
            return cls(config, embed, layers, norm, Linear(embed, pack=False))
        return cls(config, embed, layers, norm, Linear(take("lm_head.weight", c.vocab_size, c.hidden_size)))

    def set_context(self, n_positions: int) -> None:
        """Size the rotary table for positions 0..n_positions-1."""
        self._freqs = rope_table(self.inv_freq, n_positions, self.device)

    def rope(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotations [*positions.shape, 1, hd/2] for `positions`, ready to broadcast over heads."""
        return self._freqs[positions].unsqueeze(-2)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embedding, Int8Embedding):
            return self.embedding(tokens)
        return F.embedding(tokens, self.embedding)

    def layer(self, index: int, x: torch.Tensor, freqs: torch.Tensor, attend: Attend) -> torch.Tensor:
        """One decoder layer on x [B,C,D]; `freqs` from `rope` for the positions of x."""
        c, w = self.config, self.layers[index]
        batch, chunk = x.shape[:2]
        qkv = rotated_projection(w.qkv, x, w.input_norm, c.rms_norm_eps, freqs, self._qk_width, c.head_dim)
        q = qkv.narrow(-1, 0, self._q_width).view(batch, chunk, c.n_heads, c.head_dim)
        kv = qkv.narrow(-1, self._q_width, self._kv_width).view(batch, chunk, 2, c.n_kv_heads, c.head_dim)
        x = self._added(w.o, attend(index, q, kv), x)
        return self._added(w.down, gated_projection(w.gate_up, x, w.post_norm, c.rms_norm_eps), x)

    def layer_stack(self) -> LayerStack | None:
        """Every layer as one call on the node's CPU kernels, with the bits of `layer`'s calls:
        where each projection runs on them without a bias, the model is fp32, and no
        tensor-parallel sum comes between; else None."""
        return self._stack if self.reduce is None else None

    def _added(self, projection: Projection, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + projection(h), summed over the tensor-parallel group first where there is one."""
        if self.reduce is None:
            return residual_projection(projection, h, x)
        return x + self.reduce(projection(h))

    def weight_bytes(self) -> int:
        """The bytes the weights take (a tied lm_head is the embedding, counted once)."""
        parts = [self.embedding, self.norm, *(p for w in self.layers for p in vars(w).values())]
        if not (self.config.tie_word_embeddings and self.weights == WeightFormat.FLOAT):
            parts.append(self.lm_head)
        return sum(_nbytes(p) for p in parts if p is not None)

    def layer_bytes(self) -> int:
        """The bytes of the decoder layers alone: what tensor parallelism splits."""
        return sum(_nbytes(p) for w in self.layers for p in vars(w).values() if p is not None)

    def unpack_prefill(self) -> bool:
        """Let int4 projections on torch's kernel run long prefill chunks unpacked
        (`Int4Linear.unpack_prefill`); whether any can."""
        projections = self._int4_projections()
        for projection in projections:
            projection.unpack_prefill()
        return any(p.unpack_width is not None for p in projections)

    def cpu_kernels(self) -> str | None:
        """Where the node's own CPU kernels (`cpu_kernels.py`) run the quantized projections
        ("AMX", "AVX-512 VNNI", "AVX2"), or None where none does."""
        parts = [self.lm_head, *(p for layer in self.layers for p in vars(layer).values())]
        return next((p.kernels.name for p in parts if getattr(p, "kernels", None) is not None), None)

    def _int4_projections(self) -> list[Int4Linear]:
        return [p for layer in self.layers for p in vars(layer).values() if isinstance(p, Int4Linear)]

    def attention_mask(self, q_positions: torch.Tensor, n_keys: int) -> torch.Tensor:
        """[B,1,C,n_keys] bool, True where a query at q_positions [B,C] sees key position k:
        k <= q, and with a sliding window also k > q - window."""
        keys = torch.arange(n_keys, device=q_positions.device)
        q = q_positions[:, :, None]
        mask = keys <= q
        window = self.config.sliding_window
        if window is not None:
            mask &= keys > q - window
        return mask.unsqueeze(1)

    def logits(self, x: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """Final norm and lm_head, in fp32 so sampling and argmax see full precision. `greedy`:
        the caller reads only each row's argmax, which an int8 head may find more cheaply."""
        h = F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        if isinstance(self.lm_head, Int8Head):
            return self.lm_head(h, greedy=greedy)
        return self.lm_head(h).float()

    def run_causal(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Layers [start, end) over x [1,N,D] at positions 0..N-1, with no KV cache. Where the
        CPU kernels attend, the positions sit in scratch blocks of their own and the layers run
        as a step of the scheduler runs them (one call where there is a layer stack), so each
        position gets the bits the node's own prefill gives it; elsewhere SDPA under a mask."""
        if start == end:
            return x
        n, c = x.shape[1], self.config
        positions = torch.arange(n, device=self.device).unsqueeze(0)
        freqs = self.rope(positions)
        kernels = attending_kernels(self.device, self.dtype, c.head_dim, self.kv_dtype)
        if kernels is None:
            attend = self._masked_attend(positions)
        else:
            lane = CausalLane.of(n, c.n_kv_heads, c.head_dim, self.kv_dtype, self.device)
            stack = self.layer_stack()
            if stack is not None:
                return _stacked_causal(stack, x, freqs, lane, range(start, end))
            step = kernels.attention_step(lane.slots, lane.blocks, lane.starts, lane.counts, c.sliding_window or 0)

            def attend(_: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                return step(lane.layer, q, kv)

        for index in range(start, end):
            x = self.layer(index, x, freqs, attend)
        return x

    def _masked_attend(self, positions: torch.Tensor) -> Attend:
        """Attention of the rows at `positions` [1,N] to their own keys, by SDPA under a mask."""
        mask = self.attention_mask(positions, positions.shape[1])

        def attend(_: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            keys, values = kv.permute(2, 0, 3, 1, 4)
            return grouped_attention(q, keys, values, mask)

        return attend


def _stacked_causal(stack: LayerStack, x: torch.Tensor, freqs: torch.Tensor, lane: CausalLane,
                    layers: range) -> torch.Tensor:
    """`run_causal` on the layer stack: in one call where the rows fit one chunk, else a layer at
    a time in chunks of `CAUSAL_CHUNK` rows, each seeing the keys its layer's earlier chunks
    stored. A row's operations are the same either way, so are its bits; the chunks bound the
    call's buffers and keep them in cache."""
    rows = x.clone(memory_format=torch.contiguous_format)
    n = rows.shape[1]
    spans = [layers] if n <= CAUSAL_CHUNK else [range(i, i + 1) for i in layers]
    for span in spans:
        pool = lane.layer.expand(len(span), *lane.layer.shape)
        for first in range(0, n, CAUSAL_CHUNK):
            last = min(n, first + CAUSAL_CHUNK)
            starts, counts = lane.starts + first, torch.full_like(lane.counts, last - first)
            stack(rows[:, first:last], freqs[:, first:last], pool, lane.slots[first:last], lane.blocks, starts,
                  counts, span)
    return rows


def _layer_stack(c: ModelConfig, layers: list[LayerWeights]) -> LayerStack | None:
    """`LlamaModel.layer_stack`'s stack, where every layer's projections have unbiased products
    on the node's CPU kernels."""
    parts = [part for part in map(_stack_layer, layers) if part is not None]
    kernels = cpu_kernels() if layers and len(parts) == len(layers) else None
    if kernels is None:
        return None
    shape = StackShape(c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads, c.head_dim, c.rms_norm_eps,
                       c.sliding_window or 0)
    return kernels.layer_stack(parts, shape)


def _stack_layer(w: LayerWeights) -> StackLayer | None:
    qkv, o, gate_up, down = (unbiased_product(p) for p in (w.qkv, w.o, w.gate_up, w.down))
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    return StackLayer(qkv, o, gate_up, down, w.input_norm.contiguous(), w.post_norm.contiguous())


def _nbytes(part: torch.Tensor | Projection | Int8Embedding) -> int:
    if isinstance(part, torch.Tensor):
        return part.numel() * part.element_size()
    return part.nbytes


def _projection_maker(weights: WeightFormat) -> MakeProjection:
    if weights == WeightFormat.FLOAT:
        return Linear
    return lambda weight, bias: quantized_linear(weights, weight, bias)


def _layer_weights(
    c: ModelConfig,
    source: TensorSource,
    i: int,
    take: Callable[..., torch.Tensor],
    make: MakeProjection,
) -> LayerWeights:
    p, attn = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim

    def qkv_part(kind: str, suffix: str, *shape: int) -> torch.Tensor:
        """q/k rows reordered into rotary pairs; v as stored."""
        tensor = take(f"{attn}{kind}_proj.{suffix}", *shape)
        heads = {"q": c.n_heads, "k": c.n_kv_heads}.get(kind)
        return tensor if heads is None else interleave_pairs(tensor, heads, c.head_dim)

    qkv = torch.cat(
        [
            qkv_part("q", "weight", q_rows, c.hidden_size),
            qkv_part("k", "weight", kv_rows, c.hidden_size),
            qkv_part("v", "weight", kv_rows, c.hidden_size),
        ]
    )
    qkv_bias = None
    if source.has("model.layers.0.self_attn.q_proj.bias"):
        qkv_bias = torch.cat(
            [qkv_part("q", "bias", q_rows), qkv_part("k", "bias", kv_rows), qkv_part("v", "bias", kv_rows)]
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
        qkv=make(qkv, qkv_bias),
        o=make(take(attn + "o_proj.weight", c.hidden_size, q_rows), o_bias),
        post_norm=take(p + "post_attention_layernorm.weight", c.hidden_size),
        gate_up=make(gate_up, None),
        down=make(take(p + "mlp.down_proj.weight", c.hidden_size, c.intermediate_size), None),
    )


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Grouped-query attention without copying K/V per query head.

    q [B,C,H,hd]; keys, values [B,KV,T,hd]; mask [B,1,C,T] bool (True = attend). The G = H/KV
    query heads sharing a K/V head are folded into the query axis, so one SDPA call covers them.
    Returns [B,C,H*hd].
    """
    batch, chunk, n_heads, head_dim = q.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    qg = q.reshape(batch, chunk, n_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, n_kv, group * chunk, head_dim)
    if chunk > 1:
        mask = mask.unsqueeze(2).expand(batch, 1, group, chunk, mask.shape[-1])
        mask = mask.reshape(batch, 1, group * chunk, -1)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
    out = out.view(batch, n_kv, group, chunk, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, chunk, n_heads * head_dim)
