"""Per-session generation parameters, as the Rust daemon's `wal::GenParams`."""

from dataclasses import dataclass


@dataclass(frozen=True)
class GenParams:
    """Sampling knobs of one session. All zeros means greedy with no truncation.

    `top_p` 0 or 1, `top_k` 0 and `min_p` 0 each mean "off"; `seed` makes a sampled generation
    reproducible.
    """

    temperature: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    top_k: int = 0
    seed: int = 0
