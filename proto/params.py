"""Per-session generation parameters: the Python twin of the Rust daemon's `wal::GenParams`."""

from dataclasses import dataclass

from proto.postcard import F32, U32, U64


@dataclass(frozen=True)
class GenParams:
    """Sampling knobs of one session. All zeros means greedy with no truncation.

    `top_p` 0 or 1, `top_k` 0 and `min_p` 0 each mean "off"; `seed` makes a sampled generation
    reproducible. The annotations are the postcard wire types (`proto.fleet`).
    """

    temperature: F32 = 0.0
    top_p: F32 = 0.0
    min_p: F32 = 0.0
    top_k: U32 = 0
    seed: U64 = 0
