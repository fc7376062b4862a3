"""A Llama-shaped decoder: RMSNorm, rotary positions, grouped-query attention, a gated MLP,
with each family's differences (`families.spec.DecoderSpec`) read as data.

Weights are held the way decode is fastest, not the way checkpoints store them: fused (q/k/v
as one projection, gate/up as one), in the device's fastest matmul layout (`Linear`) or kept
quantized (`quant`), and q/k rows reordered so rotary positions are one complex multiply.
Attention is a callback so the same layers serve the scheduler's paged KV pool and the
cache-free stage forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

from nodeagent.engine.choices import WeightFormat
from nodeagent.engine.cpu_kernels import (
    CpuKernels,
    LayerStack,
    StackLayer,
    StackShape,
    attending_kernels,
    cpu_kernels,
)
from nodeagent.engine.families.spec import LLAMA, Activation, DecoderSpec, Norms, QKNorm, Rope, RopeFactors
from nodeagent.engine.kvpool import CausalLane
from nodeagent.engine.linear import Linear, tied_layout
from nodeagent.engine.quant import (
    Int4Linear,
    Int8Embedding,
    Int8Head,
    Int8Linear,
    gated_projection,
    held_format,
    normed_projection,
    quantized_linear,
    residual_projection,
    rotated_projection,
    unbiased_product,
)
from nodeagent.engine.rope import Frequencies, interleave_pairs, inv_frequencies, rope_table, rotate_in_place

T = TypeVar("T")

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
    #: A GGUF file's rope divisors, in place of `rope_scaling`.
    rope_factors: RopeFactors | None = None
    #: The family's maths beyond this shape.
    spec: DecoderSpec = LLAMA

    @property
    def rope(self) -> Rope:
        """The rotary positions of every layer the spec does not give its own."""
        return Rope(self.rope_theta, self.rope_scaling, self.rope_factors)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.spec.partial_rotary) // 2 * 2

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (None: it sees every earlier position)."""
        return self.spec.layer_windows[layer] if self.spec.layer_windows else self.sliding_window

    def layer_rope(self, layer: int) -> Rope | None:
        """Layer `layer`'s rotary positions (None: it has none)."""
        return self.spec.layer_ropes[layer] if self.spec.layer_ropes else self.rope


class TensorSource(Protocol):
    """Named checkpoint tensors (Hugging Face names), checked against the shape asked for."""

    def has(self, name: str) -> bool: ...

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor: ...

    def bits(self, name: str) -> int | None:
        """The bits a weight keeps in the checkpoint (4 or 8; None: float), which the engine's
        format for it follows."""
        ...


class Projection(Protocol):
    """`x @ W.T + b` over the last axis of x, W held in some format."""

    @property
    def nbytes(self) -> int: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


#: Builds a projection from a float weight [out, in], an optional bias and the bits its parts
#: keep in the checkpoint (`TensorSource.bits`).
MakeProjection = Callable[[torch.Tensor, torch.Tensor | None, int | None], Projection]


@dataclass
class LayerWeights:
    """One layer's weights; a norm the family lacks is None."""

    #: Before attention and before the MLP (`Norms.PRE`, `Norms.SANDWICH`).
    input_norm: torch.Tensor | None
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor | None
    gate_up: Projection
    down: Projection
    #: After attention's and the MLP's outputs (`Norms.POST`, `Norms.SANDWICH`).
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    #: On the queries and keys before their rotation (`QKNorm`), in the rotary pair order.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


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
        ropes = [config.layer_rope(i) for i in range(config.n_layers)]
        #: The distinct rotary positions the layers use, a table each, and each layer's table.
        self._ropes = list(dict.fromkeys(r for r in ropes if r is not None))
        self._rope_index = [None if r is None else self._ropes.index(r) for r in ropes]
        self._plain = config.spec.plain()
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
        """Size the rotary tables for positions 0..n_positions-1 (a scaling that depends on the
        context served, longrope's or dynamic NTK's, takes n_positions as that context)."""
        self._tables = [rope_table(self._frequencies(r, n_positions), n_positions, self.device) for r in self._ropes]

    def _frequencies(self, rope: Rope, context: int) -> Frequencies:
        c = self.config
        if rope.factors is not None:
            plain = inv_frequencies(c.rotary_dim, rope.theta, None).inv_freq
            divisors = torch.tensor(rope.factors.pick(context), dtype=torch.float32)
            return Frequencies(plain / divisors, rope.factors.attention_factor)
        return inv_frequencies(c.rotary_dim, rope.theta, rope.scaling, context, c.max_position_embeddings)

    def rope(self, positions: torch.Tensor) -> list[torch.Tensor]:
        """Rotations [*positions.shape, 1, rotary_dim/2] for `positions`, one for each distinct
        rope of the layers, ready to broadcast over heads; `layer` picks its own."""
        return [table[positions].unsqueeze(-2) for table in self._tables]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embedding, Int8Embedding):
            x = self.embedding(tokens)
        else:
            x = F.embedding(tokens, self.embedding)
        scale = self.config.spec.embed_scale
        return x if scale == 1.0 else x * torch.tensor(scale, dtype=x.dtype)

    def layer(self, index: int, x: torch.Tensor, rotations: list[torch.Tensor], attend: Attend) -> torch.Tensor:
        """One decoder layer on x [B,C,D]; `rotations` from `rope` for the positions of x."""
        c, w = self.config, self.layers[index]
        batch, chunk = x.shape[:2]
        rope = self._rope_index[index]
        freqs = None if rope is None else rotations[rope]
        if self._plain and freqs is not None and w.input_norm is not None:
            qkv = rotated_projection(w.qkv, x, w.input_norm, c.rms_norm_eps, freqs, self._qk_width, c.head_dim)
        else:
            qkv = self._queries_keys_values(w, x, freqs)
        q = qkv.narrow(-1, 0, self._q_width).view(batch, chunk, c.n_heads, c.head_dim)
        kv = qkv.narrow(-1, self._q_width, self._kv_width).view(batch, chunk, 2, c.n_kv_heads, c.head_dim)
        x = self._block_output(w.o, attend(index, q, kv), x, w.attn_out_norm)
        return self._block_output(w.down, self._gated_unit(w, x), x, w.mlp_out_norm)

    def _queries_keys_values(self, w: LayerWeights, x: torch.Tensor, freqs: torch.Tensor | None) -> torch.Tensor:
        """The qkv projection with the family's q/k norms, then the rotation of the rotary
        share of each q/k head; each op as Hugging Face orders them."""
        c = self.config
        qkv = self._normed(w.qkv, x, w.input_norm)
        if w.q_norm is not None and w.k_norm is not None:
            per_head = c.spec.qk_norm is QKNorm.HEAD
            q, k = qkv[..., : self._q_width], qkv[..., self._q_width : self._qk_width]
            _norm_in_place(q, w.q_norm, c.rms_norm_eps, c.head_dim if per_head else self._q_width)
            _norm_in_place(k, w.k_norm, c.rms_norm_eps, c.head_dim if per_head else self._qk_width - self._q_width)
        if freqs is not None:
            heads = qkv[..., : self._qk_width].unflatten(-1, (-1, c.head_dim))
            rotate_in_place(heads[..., : c.rotary_dim], freqs)
        return qkv

    def _normed(self, projection: Projection, x: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        if norm is None:
            return projection(x)
        return normed_projection(projection, x, norm, self.config.rms_norm_eps)

    def _gated_unit(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the MLP; SwiGLU after a norm runs in the kernels' one call."""
        c = self.config
        silu = c.spec.activation is Activation.SILU
        if silu and w.post_norm is not None:
            return gated_projection(w.gate_up, x, w.post_norm, c.rms_norm_eps)
        gate, up = self._normed(w.gate_up, x, w.post_norm).chunk(2, dim=-1)
        return (F.silu(gate) if silu else F.gelu(gate, approximate="tanh")) * up

    def _block_output(self, projection: Projection, h: torch.Tensor, x: torch.Tensor,
                      norm: torch.Tensor | None) -> torch.Tensor:
        """x + projection(h), its output normed first where the family norms it."""
        if norm is None:
            return self._added(projection, h, x)
        y = projection(h)
        if self.reduce is not None:
            y = self.reduce(y)
        return x + F.rms_norm(y, (self.config.hidden_size,), norm, self.config.rms_norm_eps)

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

    def by_window(self, make: Callable[[int | None], T]) -> Callable[[int], T]:
        """`make(window)` once for each distinct attention window of the layers, looked up by
        layer: an attention call, or a mask, per window rather than per layer."""
        windows = [self.config.window(i) for i in range(self.config.n_layers)]
        made = {window: make(window) for window in set(windows)}
        return lambda layer: made[windows[layer]]

    def attention_kernels(self, kv_dtype: torch.dtype) -> CpuKernels | None:
        """The node's CPU kernels where they attend for this model over a pool of `kv_dtype`
        (`attending_kernels`); never for a family that caps its attention scores, which they
        do not."""
        if self.config.spec.attn_softcap is not None:
            return None
        return attending_kernels(self.device, self.dtype, self.config.head_dim, kv_dtype)

    def attention_mask(self, q_positions: torch.Tensor, n_keys: int, window: int | None) -> torch.Tensor:
        """[B,1,C,n_keys] bool, True where a query at q_positions [B,C] sees key position k:
        k <= q, and with a sliding window also k > q - window."""
        keys = torch.arange(n_keys, device=q_positions.device)
        q = q_positions[:, :, None]
        mask = keys <= q
        if window is not None:
            mask &= keys > q - window
        return mask.unsqueeze(1)

    def logits(self, x: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """Final norm and lm_head, in fp32 so sampling and argmax see full precision. `greedy`:
        the caller reads only each row's argmax, which an int8 head may find more cheaply."""
        h = F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        logits = self.lm_head(h, greedy=greedy) if isinstance(self.lm_head, Int8Head) else self.lm_head(h).float()
        spec = self.config.spec
        if spec.logit_scale != 1.0:
            logits = logits * spec.logit_scale
        if spec.final_softcap is not None:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits

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
        kernels = self.attention_kernels(self.kv_dtype)
        if kernels is None:
            attend = self._masked_attend(positions)
        else:
            lane = CausalLane.of(n, c.n_kv_heads, c.head_dim, self.kv_dtype, self.device)
            stack = self.layer_stack()
            if stack is not None:
                return _stacked_causal(stack, x, freqs[0], lane, range(start, end))
            step = self.by_window(lambda w: kernels.attention_step(lane.slots, lane.blocks, lane.starts,
                                                                   lane.counts, w or 0))

            def attend(index: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                return step(index)(lane.layer, q, kv)

        for index in range(start, end):
            x = self.layer(index, x, freqs, attend)
        return x

    def _masked_attend(self, positions: torch.Tensor) -> Attend:
        """Attention of the rows at `positions` [1,N] to their own keys, by SDPA under a mask."""
        mask = self.by_window(lambda w: self.attention_mask(positions, positions.shape[1], w))
        softcap = self.config.spec.attn_softcap

        def attend(index: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            keys, values = kv.permute(2, 0, 3, 1, 4)
            return grouped_attention(q, keys, values, mask(index), softcap)

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
    if not c.spec.plain():
        return None
    parts = [part for part in map(_stack_layer, layers) if part is not None]
    kernels = cpu_kernels() if layers and len(parts) == len(layers) else None
    if kernels is None:
        return None
    shape = StackShape(c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads, c.head_dim, c.rms_norm_eps,
                       c.window(0) or 0)
    return kernels.layer_stack(parts, shape)


def _stack_layer(w: LayerWeights) -> StackLayer | None:
    qkv, o, gate_up, down = (unbiased_product(p) for p in (w.qkv, w.o, w.gate_up, w.down))
    if qkv is None or o is None or gate_up is None or down is None or w.input_norm is None or w.post_norm is None:
        return None
    return StackLayer(qkv, o, gate_up, down, w.input_norm.contiguous(), w.post_norm.contiguous())


def _nbytes(part: torch.Tensor | Projection | Int8Embedding) -> int:
    if isinstance(part, torch.Tensor):
        return part.numel() * part.element_size()
    return part.nbytes


def _projection_maker(weights: WeightFormat) -> MakeProjection:
    """Float, or each weight in the format `held_format` gives it under `weights`."""
    if weights == WeightFormat.FLOAT:
        return lambda weight, bias, _: Linear(weight, bias)
    return lambda weight, bias, bits: quantized_linear(held_format(weights, bits), weight, bias)


def _layer_weights(
    c: ModelConfig,
    source: TensorSource,
    i: int,
    take: Callable[..., torch.Tensor],
    make: MakeProjection,
) -> LayerWeights:
    """Layer i's weights under the engine's names (`families.base`'s canonical names), with the
    spec's scales folded in: the query scale into q (or its norm), the residual scale into o and
    down."""
    p, attn, spec = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", c.spec
    q_rows, kv_rows, rot = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.rotary_dim
    scale_q = spec.query_scale if spec.qk_norm is QKNorm.NONE else 1.0

    def qkv_part(kind: str, suffix: str, *shape: int) -> torch.Tensor:
        """q/k rows reordered into rotary pairs; v as stored."""
        tensor = take(f"{attn}{kind}_proj.{suffix}", *shape)
        if kind == "q" and scale_q != 1.0:
            tensor = tensor * scale_q
        heads = {"q": c.n_heads, "k": c.n_kv_heads}.get(kind)
        return tensor if heads is None else interleave_pairs(tensor, heads, c.head_dim, rot)

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
        o_bias = take(attn + "o_proj.bias", c.hidden_size) * spec.residual_scale
    gate_up = torch.cat(
        [
            take(p + "mlp.gate_proj.weight", c.intermediate_size, c.hidden_size),
            take(p + "mlp.up_proj.weight", c.intermediate_size, c.hidden_size),
        ]
    )
    o = take(attn + "o_proj.weight", c.hidden_size, q_rows)
    down = take(p + "mlp.down_proj.weight", c.hidden_size, c.intermediate_size)
    if spec.residual_scale != 1.0:
        o, down = o * spec.residual_scale, down * spec.residual_scale
    before, after = spec.norms is not Norms.POST, spec.norms is not Norms.PRE

    def norm(name: str) -> torch.Tensor:
        return take(p + name, c.hidden_size)

    q_norm = k_norm = None
    if spec.qk_norm is not QKNorm.NONE:
        per_head = spec.qk_norm is QKNorm.HEAD
        q_norm = interleave_pairs(take(attn + "q_norm.weight", c.head_dim if per_head else q_rows),
                                  1 if per_head else c.n_heads, c.head_dim, rot) * spec.query_scale
        k_norm = interleave_pairs(take(attn + "k_norm.weight", c.head_dim if per_head else kv_rows),
                                  1 if per_head else c.n_kv_heads, c.head_dim, rot)
    def bits(*names: str) -> int | None:
        kept = [b for b in (source.bits(p + name) for name in names) if b is not None]
        return max(kept, default=None)

    return LayerWeights(
        input_norm=norm("input_layernorm.weight") if before else None,
        qkv=make(qkv, qkv_bias, bits(*(f"self_attn.{part}_proj.weight" for part in "qkv"))),
        o=make(o, o_bias, bits("self_attn.o_proj.weight")),
        post_norm=norm("post_attention_layernorm.weight") if before else None,
        gate_up=make(gate_up, None, bits("mlp.gate_proj.weight", "mlp.up_proj.weight")),
        down=make(down, None, bits("mlp.down_proj.weight")),
        attn_out_norm=norm("attn_out_norm.weight") if after else None,
        mlp_out_norm=norm("mlp_out_norm.weight") if after else None,
        q_norm=q_norm,
        k_norm=k_norm,
    )


def _norm_in_place(part: torch.Tensor, weight: torch.Tensor, eps: float, width: int) -> None:
    """RMSNorm `part` [..., n] in place over each run of `width` values."""
    part.copy_(F.rms_norm(part.unflatten(-1, (-1, width)), (width,), weight, eps).flatten(-2))


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, softcap: float | None = None
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
    if softcap is None:
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
    else:
        out = _capped_attention(qg, keys, values, mask, softcap)
    out = out.view(batch, n_kv, group, chunk, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, chunk, n_heads * head_dim)


def _capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      softcap: float) -> torch.Tensor:
    """Attention whose scores are soft-capped, tanh(s / cap) * cap, before the softmax (Gemma 2),
    which SDPA cannot do."""
    scores = (q @ keys.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (weights.to(values.dtype) @ values)
