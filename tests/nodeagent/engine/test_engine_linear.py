"""The packed projection pads its rows to a few sizes, so oneDNN's per-shape caches stay
bounded however the prefill chunks vary (issue 34), with the product unchanged."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nodeagent.engine import linear
from nodeagent.engine.linear import EXACT_ROWS, Linear, can_pack, padded_rows

needs_packing = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN packing")


def test_a_decode_steps_rows_run_as_they_are_and_larger_counts_pad_by_under_a_quarter():
    assert [padded_rows(r) for r in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    assert [padded_rows(r) for r in range(9, 18)] == [10, 10, 12, 12, 14, 14, 16, 16, 20]
    for rows in range(1, 5000):
        assert rows <= padded_rows(rows) < 1.25 * rows
        assert padded_rows(padded_rows(rows)) == padded_rows(rows)


def test_every_prefill_chunk_up_to_512_rows_runs_at_one_of_32_sizes():
    assert len({padded_rows(r) for r in range(1, 513)}) == 32


@needs_packing
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 1, 64), (3, 7, 64), (1, 37, 64), (2, 129, 64)])
def test_padded_rows_give_the_product_of_the_rows_given(shape):
    weight, bias = torch.randn(48, 64), torch.randn(48)
    x = torch.randn(*shape)
    y = Linear(weight, bias)(x)
    assert y.shape == (*shape[:-1], 48)
    torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


@needs_packing
def test_onednn_meets_only_the_padded_row_counts(monkeypatch):
    seen = set()
    packed = Linear._packed

    def recording(self, x):
        seen.add(x.numel() // self.in_features)
        return packed(self, x)

    monkeypatch.setattr(linear.Linear, "_packed", recording)
    projection = Linear(torch.randn(16, 32))
    for rows in range(1, 300):
        projection(torch.randn(rows, 32))
    assert seen == {padded_rows(r) for r in range(1, 300)}
    assert len(seen) <= 8 + 4 * 6


CAPPED_SWEEP = """
import resource, sys, torch
from nodeagent.engine.linear import Linear, bound_kernel_caches
bound_kernel_caches()
projection = Linear(torch.randn(256, 64))
def sweep(counts):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for rows in counts:
        projection._packed(torch.zeros(rows, 64))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
sweep(range(1, 121))
print(sweep(range(121, 241)))
"""


@needs_packing
def test_capped_kernel_caches_stop_growing_however_many_row_counts_arrive():
    """Unpadded row counts, each new: past the cap, 120 more add next to nothing, where each
    would keep half a megabyte of primitives uncapped (`linear.bound_kernel_caches`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, "-c", CAPPED_SWEEP], capture_output=True, text=True, env=env, check=True)
    grown_kb = int(done.stdout)
    assert grown_kb < 120 * 512 / 4, f"the second 120 row counts grew the process by {grown_kb} KB"


def test_loading_a_torch_engine_caps_the_kernel_caches_the_operator_left_unset():
    code = (
        "import os; from nodeagent.engine.torch_engine import TorchDaemon; "
        "TorchDaemon.load('builtin', device='cpu').close(); "
        "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    env["LRU_CACHE_CAPACITY"] = "200"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.split() == [str(linear.KERNEL_CACHE_ENTRIES), "200"]
