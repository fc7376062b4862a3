"""A paged KV cache: per layer, 16-token blocks of K and V, shared between generations through a
prefix cache.

A generation owns a list of blocks; its position p lives in slot `block[p // 16] * 16 + p % 16`.
A layer holds K, then V, each as a plane per KV head with every block in turn
([2, KV, blocks, 16, head_dim]), so a lane's blocks in order are two streams of memory a head.
Within a block, a head's keys are held transposed ([head_dim, 16], a token per column) and its
values as they come ([16, head_dim]): the CPU attention kernel (`cpu_attention.h`) scores a
block's 16 keys as one vector and reads the blocks in place. Elsewhere `read` copies the blocks
out for SDPA. One extra block past the end is scratch: padded query positions write there and
padded key positions read from there, so a batch never needs a branch for ragged lanes.

A full block can be published under a key that names its 16 tokens and every token before them
(`chain_key`); a later prompt with the same start takes the block instead of recomputing it.
Blocks are reference-counted: one nobody holds but that has a key stays cached, and is the
first to be reused when the pool runs dry, least recently released first. Only the scheduler
thread calls the methods that change the pool.

The storage is allocated empty, so pages the pool never hands out are never touched; a block is
zeroed when handed out, since attention reads a whole block and NaN garbage in its unwritten
slots would leak through the zero attention weights (0 × NaN is NaN).
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK_TOKENS = 16
#: The dimension of `KVPool.kv` [layers, 2, KV, blocks, 16, hd] that counts blocks.
BLOCK_DIM = 3
#: Enough that two different token chains never share a key in practice.
KEY_BYTES = 16


def blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK_TOKENS)


def bytes_per_block(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V for 16 tokens across every layer."""
    return 2 * n_layers * n_kv_heads * head_dim * BLOCK_TOKENS * dtype.itemsize


def chain_key(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block holding `tokens` after the block keyed `previous` (b"" at the start)."""
    digest = hashlib.blake2b(previous, digest_size=KEY_BYTES)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


@dataclass(frozen=True)
class CausalLane:
    """One lane at positions 0..n-1 in blocks of its own, for a pass without a KV cache
    (`LlamaModel.run_causal`): `layer` holds one layer's blocks, zeroed, and every layer in turn
    stores its K and V there over the previous layer's before attending to them. The other
    fields are the lane as `CpuKernels.attention` takes it."""

    layer: torch.Tensor
    slots: torch.Tensor
    blocks: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, n_tokens: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> CausalLane:
        n_blocks = blocks_for(n_tokens)
        layer = torch.zeros(2, n_kv_heads, n_blocks, BLOCK_TOKENS, head_dim, dtype=dtype, device=device)
        return cls(
            layer,
            slots=torch.arange(n_tokens, device=device),
            blocks=torch.arange(n_blocks, device=device).unsqueeze(0),
            starts=torch.zeros(1, dtype=torch.long, device=device),
            counts=torch.tensor([n_tokens], device=device),
        )


class KVPool:
    """The K/V storage, its reference counts, free list and prefix cache."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if n_blocks < 1:
            raise ValueError("a KV pool needs at least one block")
        shape = (n_layers, 2, n_kv_heads, n_blocks + 1, BLOCK_TOKENS, head_dim)
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self.total = n_blocks
        self.scratch_block = n_blocks
        self.scratch_slot = n_blocks * BLOCK_TOKENS
        self.blocks(n_blocks).zero_()
        self._refs = [0] * n_blocks
        #: Unheld blocks without a key; the last released is reused first, so the pool's
        #: resident memory stays as small as its use.
        self._free = list(range(n_blocks - 1, -1, -1))
        #: Unheld blocks with a key, least recently released first.
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        #: Blocks zeroed since `take_fresh` was last called: under tensor parallelism the
        #: other ranks zero them in their own pools too.
        self._fresh: list[int] = []

    @property
    def used(self) -> int:
        """Blocks some generation holds."""
        return self.total - self.available

    @property
    def available(self) -> int:
        """Blocks `allocate` can hand out: free ones, and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def cached(self) -> int:
        """Blocks published under a key, held or not."""
        return len(self._key_of)

    def allocate(self, n_blocks: int) -> list[int] | None:
        """`n_blocks` zeroed blocks, held once, in ascending order (a lane's blocks in order
        in memory); None (and nothing taken) when too few are available. Free blocks go
        first, then the least recently released cached ones."""
        if n_blocks > self.available:
            return None
        taken = sorted(self._free.pop() if self._free else self._evict() for _ in range(n_blocks))
        for block in taken:
            self._refs[block] = 1
        if taken:
            self.zero(taken)
            self._fresh += taken
        return taken

    def blocks(self, which: int | slice | list[int]) -> torch.Tensor:
        """Every layer's K and V of block(s) `which` (a view where indexing gives one)."""
        return self.kv[(slice(None),) * BLOCK_DIM + (which,)]

    def zero(self, blocks: Sequence[int]) -> None:
        self.kv.index_fill_(BLOCK_DIM, torch.tensor(blocks, device=self.kv.device), 0)

    def take_fresh(self) -> list[int]:
        """The blocks zeroed since the last call, which another rank's pool must zero too."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def _evict(self) -> int:
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one hold on each of `blocks`; an unheld block stays cached if it has a key.
        They go back last first: a chain's tail is then evicted before its start, which every
        later match needs, and the free blocks a lane held come out again first to last."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the start; nothing is held."""
        found = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def idle_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` nobody holds (they count as available until taken)."""
        return sum(1 for block in blocks if not self._refs[block])

    def hold(self, blocks: Sequence[int]) -> None:
        """One more hold on each of `blocks` (cached blocks a new prompt reuses)."""
        for block in blocks:
            if not self._refs[block]:
                del self._idle[block]
            self._refs[block] += 1

    def publish(self, block: int, key: bytes) -> None:
        """Offer a full, held `block` for reuse under `key`. The first block with a key keeps
        it; a duplicate stays private and is freed when released."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store kv [N,2,KV,hd] at `slots` [N], as the pool's dtype holds it."""
        block, token = slots // BLOCK_TOKENS, slots % BLOCK_TOKENS
        kv = kv.to(self.kv.dtype)
        _transposed_keys(self.kv[layer, 0])[:, block, :, token] = kv[:, 0]
        self.kv[layer, 1][:, block, token] = kv[:, 1].transpose(0, 1)

    def read(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B,KV,T,hd] of `blocks` [B,nb], T = nb * 16."""
        batch = blocks.shape[0]
        keys, values = self.kv[layer].index_select(BLOCK_DIM - 1, blocks.flatten())
        keys = _transposed_keys(keys).transpose(-1, -2)
        return _tokens_in_order(keys, batch), _tokens_in_order(values, batch)


def _transposed_keys(planes: torch.Tensor) -> torch.Tensor:
    """The keys of planes [KV,N,16,hd] as they are held: [KV,N,hd,16]."""
    return planes.flatten(-2).unflatten(-1, (planes.shape[-1], BLOCK_TOKENS))


def _tokens_in_order(planes: torch.Tensor, batch: int) -> torch.Tensor:
    """[KV,B*nb,16,hd] as [B,KV,nb*16,hd]."""
    n_kv, head_dim = planes.shape[0], planes.shape[-1]
    return planes.reshape(n_kv, batch, -1, head_dim).transpose(0, 1)
