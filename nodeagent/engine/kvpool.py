"""A paged KV cache: per layer, 16-token blocks of K and V side by side, shared between
generations through a prefix cache.

A generation owns a list of blocks; its position p lives in slot `block[p // 16] * 16 + p % 16`.
Writes address slots; reads fetch whole blocks, which copies 16 tokens per index. One extra
block past the end is scratch: padded query positions write there and padded key positions read
from there, so a batch never needs a branch for ragged lanes.

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

import torch

BLOCK_TOKENS = 16
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
        shape = (n_layers, n_blocks + 1, BLOCK_TOKENS, 2, n_kv_heads, head_dim)
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self.total = n_blocks
        self.scratch_block = n_blocks
        self.scratch_slot = n_blocks * BLOCK_TOKENS
        self.kv[:, n_blocks].zero_()
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
        """`n_blocks` zeroed blocks, held once; None (and nothing taken) when too few are
        available. Free blocks go first, then the least recently released cached ones."""
        if n_blocks > self.available:
            return None
        taken = []
        for _ in range(n_blocks):
            taken.append(self._free.pop() if self._free else self._evict())
        for block in taken:
            self._refs[block] = 1
        if taken:
            self.zero(taken)
            self._fresh += taken
        return taken

    def zero(self, blocks: Sequence[int]) -> None:
        self.kv.index_fill_(1, torch.tensor(blocks, device=self.kv.device), 0)

    def take_fresh(self) -> list[int]:
        """The blocks zeroed since the last call, which another rank's pool must zero too."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def _evict(self) -> int:
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one hold on each of `blocks`; an unheld block stays cached if it has a key."""
        for block in blocks:
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
        """Store kv [N,2,KV,hd] at `slots` [N]."""
        self.kv[layer].view(-1, *kv.shape[1:]).index_copy_(0, slots, kv)

    def read(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B,KV,T,hd] of `blocks` [B,nb], T = nb * 16."""
        batch, n_blocks = blocks.shape
        taken = self.kv[layer].index_select(0, blocks.flatten())
        taken = taken.view(batch, n_blocks * BLOCK_TOKENS, *taken.shape[2:])
        return taken[:, :, 0].transpose(1, 2), taken[:, :, 1].transpose(1, 2)
