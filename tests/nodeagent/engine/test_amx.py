"""The AMX int4 prefill kernel: its products, their independence from the rows beside them, and
how the node falls back where the kernel cannot run."""

from __future__ import annotations

import pytest
import torch

from nodeagent.engine import amx
from nodeagent.engine.quant import INT4_GROUP, UNPACK_ROWS, Int4Linear

#: A bf16 output rounds at 2^-9; summed over a row's products the relative error stays near it.
TOLERANCE = 4e-3


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """`int4_kernel` worked out again, building into an empty cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    amx.int4_kernel.cache_clear()
    yield
    amx.int4_kernel.cache_clear()


def _kernel_or_skip() -> amx.Int4Kernel:
    kernel = amx.int4_kernel()
    if kernel is None:
        pytest.skip("no AMX kernel here: " + (amx._unusable() or "it failed to build or load"))
    return kernel


def _projection(rows: int, columns: int, seed: int) -> Int4Linear:
    generator = torch.Generator().manual_seed(seed)
    return Int4Linear(torch.randn(rows, columns, generator=generator) * 0.05)


@pytest.mark.parametrize(("out_features", "in_features"), [(192, 576), (1536, 576), (576, 1536), (512, 2048)])
@pytest.mark.parametrize("count", [1, 15, 16, 17, 64, 130])
def test_the_kernel_multiplies_by_the_weight_rounded_to_bf16(out_features, in_features, count):
    kernel = _kernel_or_skip()
    projection = _projection(out_features, in_features, seed=count)
    rows = torch.randn(count, in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    product = kernel(rows, projection.packed, projection.scales_and_zeros, INT4_GROUP).double()
    weight = projection.dequantized().to(torch.bfloat16).double()
    exact = rows.double() @ weight.t()
    assert ((product - exact).norm(dim=1) / exact.norm(dim=1)).max() < TOLERANCE


def test_a_rows_products_do_not_depend_on_the_rows_beside_it():
    kernel = _kernel_or_skip()
    projection = _projection(1536, 576, seed=0)
    rows = torch.randn(100, 576, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    together = kernel(rows, projection.packed, projection.scales_and_zeros, INT4_GROUP)
    for index in (0, 15, 16, 57, 99):
        alone = kernel(rows[index : index + 1].contiguous(), projection.packed, projection.scales_and_zeros, INT4_GROUP)
        assert torch.equal(alone[0], together[index])
    shifted = kernel(rows[7:].contiguous(), projection.packed, projection.scales_and_zeros, INT4_GROUP)
    assert torch.equal(shifted, together[7:])


def test_fast_prefill_chunks_run_on_the_kernel_and_short_ones_on_torchs():
    kernel = _kernel_or_skip()
    projection = _projection(576, 576, seed=3)
    projection.unpack_prefill()
    assert projection.amx is kernel
    chunk = torch.randn(UNPACK_ROWS, 576, generator=torch.Generator().manual_seed(4))
    expected = kernel(chunk.to(torch.bfloat16), projection.packed, projection.scales_and_zeros, INT4_GROUP)
    assert torch.equal(projection(chunk), expected.float())
    step = chunk[:1]
    torchs = torch.ops.aten._weight_int4pack_mm_for_cpu(
        step.to(torch.bfloat16), projection.packed, INT4_GROUP, projection.scales_and_zeros
    )
    assert torch.equal(projection(step), torchs.float())


def test_the_switch_turns_the_kernel_off(fresh_kernel, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_AMX", "0")
    assert amx.int4_kernel() is None
    projection = _projection(576, 576, seed=5)
    projection.unpack_prefill()
    assert projection.amx is None


def test_a_compiler_that_fails_leaves_prefill_on_torch_and_says_why(fresh_kernel, monkeypatch, caplog):
    if amx.CPU_FLAGS - amx._cpu_flags():
        pytest.skip("the processor check refuses before the compiler runs")
    monkeypatch.setenv("CC", "false")
    with caplog.at_level("INFO", logger="nodeagent.engine.amx"):
        assert amx.int4_kernel() is None
    assert "building it failed" in caplog.text


def test_the_build_is_cached_by_source(fresh_kernel, tmp_path):
    _kernel_or_skip()
    built = list((tmp_path / "superfluid").glob("int4_amx-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    amx.int4_kernel.cache_clear()
    assert amx.int4_kernel() is not None
    assert built[0].stat().st_mtime_ns == stamp
