"""The truncations a sampling lane applies, one knob at a time."""

from __future__ import annotations

import torch

from nodeagent.engine.sampling import LaneSampler, choose_tokens
from proto.params import GenParams

CPU = torch.device("cpu")
PROBS = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
LOGITS = PROBS.log()


def kept(**knobs) -> list[int]:
    dist = LaneSampler(GenParams(temperature=1.0, **knobs), CPU).distribution(LOGITS)
    assert torch.isclose(dist.sum(), torch.tensor(1.0))
    return sorted(torch.nonzero(dist).flatten().tolist())


def test_each_knob_truncates_as_documented():
    assert kept() == [0, 1, 2, 3, 4]
    assert kept(top_k=2) == [1, 3]
    assert kept(top_p=0.65) == [1, 3]
    assert kept(top_p=0.75) == [1, 3, 4]
    assert kept(min_p=0.3) == [1, 3, 4]
    assert kept(top_k=3, top_p=0.5) == [1, 3]


def test_off_values_change_nothing():
    full = LaneSampler(GenParams(temperature=1.0), CPU).distribution(LOGITS)
    off = LaneSampler(GenParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0), CPU).distribution(LOGITS)
    assert torch.allclose(full, PROBS)
    assert torch.equal(full, off)


def test_temperature_sharpens_and_flattens():
    cold = LaneSampler(GenParams(temperature=0.5), CPU).distribution(LOGITS)
    hot = LaneSampler(GenParams(temperature=2.0), CPU).distribution(LOGITS)
    assert cold[1] > PROBS[1] > hot[1]


def test_greedy_rows_take_the_argmax_and_seeded_rows_repeat():
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    seeded = GenParams(temperature=1.0, seed=99)
    draws = []
    for _ in range(2):
        samplers = [LaneSampler(GenParams(), CPU), LaneSampler(GenParams(), CPU), LaneSampler(seeded, CPU)]
        draws.append([choose_tokens(logits, samplers) for _ in range(20)])
    assert all(row[:2] == [1, 3] for row in draws[0])
    assert draws[0] == draws[1]
    assert len({row[2] for row in draws[0]}) > 1
