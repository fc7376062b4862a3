"""The fleet mock's algorithm, computed from its spec (mock-engine.md) and nothing else.

A node serving `--engine mock` must give exactly these tokens and stage values, since the Rust
fleet checks every node against its mock token for token. This is the kit's own reference: it
never imports the node's engine, because checking the node with the node's code proves nothing.
The context is hashed anew at every step, the plainest reading of the spec.
"""

from __future__ import annotations

import struct

import xxhash

MOCK_VOCAB = 32000
MOCK_LAYERS = 24


def _hash(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _le32s(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def mock_tokens(prompt: list[int], max_new: int, seed: int = 0) -> list[int]:
    """The mock's generation: step k hashes LE32 of every token so far, then
    LE64(seed + len(prompt) + k), and takes the hash modulo the vocabulary."""
    context = list(prompt)
    base = seed + len(prompt)
    for k in range(max_new):
        data = _le32s(context) + struct.pack("<Q", (base + k) % 2**64)
        context.append(_hash(data) % MOCK_VOCAB)
    return context[len(prompt):]


def mock_stage(tokens: list[int], start: int, end: int, hidden_in: bytes | None = None) -> bytes | int:
    """The mock's stage forward over layers [start, end): the 8 hidden bytes before the last
    layer, the token once the range reaches it."""
    h = _hash(_le32s(tokens)) if hidden_in is None else int.from_bytes(hidden_in, "little")
    for layer in range(start, end):
        h = _hash(struct.pack("<QI", h, layer))
    return h % MOCK_VOCAB if end >= MOCK_LAYERS else struct.pack("<Q", h)
