"""Per-lane token choice from GenParams.

Each sampling lane draws from its own `torch.Generator` seeded from `seed`, so a seeded
generation yields the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from proto.params import GenParams


class LaneSampler:
    """Temperature, top-k, top-p and min-p for one generation; greedy at temperature 0."""

    def __init__(self, params: GenParams, device: torch.device):
        self.params = params
        self.greedy = params.temperature <= 0
        self.generator = None
        if not self.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)

    def sample(self, logits: torch.Tensor) -> int:
        """One token from fp32 logits [V]."""
        probs = self.distribution(logits)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The truncated, renormalised distribution the token is drawn from."""
        p = self.params
        logits = logits / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if 0 < p.top_p < 1:
            probs = _top_p(probs, p.top_p)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs / probs.sum()


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p`."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(0, order, sorted_probs)


def choose_tokens(logits: torch.Tensor, samplers: list[LaneSampler]) -> list[int]:
    """One token per row of `logits` [B,V]: one argmax for all, then the sampling lanes."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, sampler in enumerate(samplers):
        if not sampler.greedy:
            tokens[row] = sampler.sample(logits[row])
    return tokens
