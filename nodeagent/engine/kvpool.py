"""A paged KV cache: per layer, 16-token blocks of K and V side by side.

A generation owns a list of blocks; its position p lives in slot `block[p // 16] * 16 + p % 16`.
Writes address slots; reads fetch whole blocks, which copies 16 tokens per index. One extra
block past the end is scratch: padded query positions write there and padded key positions read
from there, so a batch never needs a branch for ragged lanes. Only the scheduler thread
allocates and releases.
"""

from __future__ import annotations

import torch

BLOCK_TOKENS = 16


def blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK_TOKENS)


def bytes_per_block(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V for 16 tokens across every layer."""
    return 2 * n_layers * n_kv_heads * head_dim * BLOCK_TOKENS * dtype.itemsize


class KVPool:
    """The K/V storage and its free list."""

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
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.total = n_blocks
        self.scratch_block = n_blocks
        self.scratch_slot = n_blocks * BLOCK_TOKENS
        self._free = list(range(n_blocks - 1, -1, -1))

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    def allocate(self, n_blocks: int) -> list[int] | None:
        """`n_blocks` blocks, or None (and nothing taken) when too few are free."""
        if n_blocks > len(self._free):
            return None
        taken = self._free[-n_blocks:] if n_blocks else []
        del self._free[len(self._free) - n_blocks :]
        return taken

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store kv [N,2,KV,hd] at `slots` [N]."""
        self.kv[layer].view(-1, *kv.shape[1:]).index_copy_(0, slots, kv)

    def read(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B,KV,T,hd] of `blocks` [B,nb], T = nb * 16."""
        batch, n_blocks = blocks.shape
        taken = self.kv[layer].index_select(0, blocks.flatten())
        taken = taken.view(batch, n_blocks * BLOCK_TOKENS, *taken.shape[2:])
        return taken[:, :, 0].transpose(1, 2), taken[:, :, 1].transpose(1, 2)
