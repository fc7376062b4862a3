"""One rank's share of a model under tensor parallelism, Megatron-style.

Each layer splits across the ranks: q/k/v by attention heads (whole KV-head groups, so a query
head and its K/V head stay on one rank) and gate/up by rows, which are column-parallel and
need no communication; o and down by columns, row-parallel, each rank holding a partial sum
that one all-reduce completes. The embedding, the norms and the lm_head are replicated: every
rank ends a layer with the whole hidden state, and rank 0 alone reads the logits.

`ShardedSource` hands `LlamaModel.from_source` a rank's slices of a checkpoint's tensors under
the shapes of `shard_config`, so loading, fusing, quantizing and the forward are the ones a
single device uses.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from nodeagent.daemon import ModelLoadError
from nodeagent.engine.families.spec import QKNorm
from nodeagent.engine.model import ModelConfig, TensorSource

#: Tensor-name suffix -> the dimension split across ranks; the unlisted are replicated.
_SPLIT_DIM = {
    "self_attn.q_proj.weight": 0,
    "self_attn.q_proj.bias": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.k_proj.bias": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.v_proj.bias": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.down_proj.weight": 1,
}
#: A row-parallel bias is added once, by rank 0: the all-reduce sums the ranks' outputs.
_ONCE = ("self_attn.o_proj.bias",)
_LAYER = re.compile(r"^model\.layers\.\d+\.(.+)$")


class ShardError(ModelLoadError):
    """The model does not split across that many ranks."""


def shard_config(config: ModelConfig, world: int, model: str) -> ModelConfig:
    """The layer shapes each of `world` ranks holds; ShardError naming the count that does not
    divide."""
    if config.spec.qk_norm is QKNorm.PROJECTION:
        raise ShardError(
            f"{model} cannot run on {world} tensor-parallel ranks: its q/k norms ({config.spec.family}) "
            f"span every head of a layer, which the ranks split"
        )
    counts = {
        "attention heads": config.n_heads,
        "KV heads": config.n_kv_heads,
        "MLP width": config.intermediate_size,
    }
    for what, n in counts.items():
        if n % world:
            raise ShardError(
                f"{model} cannot run on {world} tensor-parallel ranks: its {n} {what} do not split "
                f"{world} ways ({config.n_heads} attention heads, {config.n_kv_heads} KV heads)"
            )
    return dataclasses.replace(
        config,
        n_heads=config.n_heads // world,
        n_kv_heads=config.n_kv_heads // world,
        intermediate_size=config.intermediate_size // world,
    )


class ShardedSource:
    """Rank `rank` of `world`'s slice of each tensor `source` holds."""

    def __init__(self, source: TensorSource, rank: int, world: int) -> None:
        self.source = source
        self.rank = rank
        self.world = world

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def bits(self, name: str) -> int | None:
        return self.source.bits(name)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The slice of `name` whose shape is `shape` (the sharded config's)."""
        suffix = _suffix(name)
        dim = _SPLIT_DIM.get(suffix)
        if dim is None:
            whole = self.source.get(name, shape)
            return whole if suffix not in _ONCE or self.rank == 0 else torch.zeros_like(whole)
        full = list(shape)
        full[dim] *= self.world
        whole = self.source.get(name, tuple(full))
        return whole.narrow(dim, self.rank * shape[dim], shape[dim]).clone()


def _suffix(name: str) -> str:
    m = _LAYER.match(name)
    return m.group(1) if m else name


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which rank of how many a process loads the model for."""

    rank: int
    world: int


def sharded(
    config: ModelConfig, source: TensorSource, shard: Shard | None, model: str
) -> tuple[ModelConfig, TensorSource]:
    """`config` and `source` as rank `shard.rank` loads them; as they are without a shard."""
    if shard is None or shard.world == 1:
        return config, source
    return shard_config(config, shard.world, model), ShardedSource(source, shard.rank, shard.world)
