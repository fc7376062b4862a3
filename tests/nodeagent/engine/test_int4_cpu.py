"""The exact int4 CPU kernel: its products, the same bits on its vector and tile paths and
whatever rows run beside a row, and how the node falls back where it cannot run."""

from __future__ import annotations

import copy

import pytest
import torch

from nodeagent.engine import int4_cpu
from nodeagent.engine.quant import Int4Linear

#: Activations keep 16 bits against their group's largest, so products stay near 2^-15.
TOLERANCE = 2e-4


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """`int4_kernel` worked out again, building into an empty cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    int4_cpu.int4_kernel.cache_clear()
    yield
    int4_cpu.int4_kernel.cache_clear()


def _kernel_or_skip() -> int4_cpu.Int4Kernel:
    kernel = int4_cpu.int4_kernel()
    if kernel is None:
        pytest.skip("no int4 CPU kernel here: " + (int4_cpu._unusable() or "it failed to build or load"))
    return kernel


def _both_paths() -> list[int4_cpu.Int4Kernel]:
    """The kernel as it runs here, and the same kernel kept to its vector path."""
    kernel = _kernel_or_skip()
    vector = copy.copy(kernel)
    vector.tiles = False
    return [kernel, vector]


def _projection(rows: int, columns: int, seed: int) -> Int4Linear:
    generator = torch.Generator().manual_seed(seed)
    return Int4Linear(torch.randn(rows, columns, generator=generator) * 0.05)


def _rows(count: int, columns: int, seed: int) -> torch.Tensor:
    """Activations with an outlier channel, as real models have."""
    rows = torch.randn(count, columns, generator=torch.Generator().manual_seed(seed))
    rows[:, 5] *= 40
    return rows


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).norm(dim=1) / want.norm(dim=1)).max())


@pytest.mark.parametrize(("out_features", "in_features"), [(64, 32), (192, 576), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("count", [1, 3, 4, 16, 17, 130])
def test_the_kernel_multiplies_by_its_weight_with_activations_kept_to_16_bits(out_features, in_features, count):
    projection = _projection(out_features, in_features, seed=count)
    if projection.kernel is None:
        pytest.skip("no int4 CPU kernel here")
    rows = _rows(count, in_features, seed=1)
    exact = rows.double() @ projection.dequantized().double().t()
    in_bf16 = rows.to(torch.bfloat16).double() @ projection.dequantized().double().t()
    assert _relative(projection(rows), exact) < TOLERANCE
    assert _relative(projection(rows), exact) < _relative(in_bf16, exact) / 5


def test_the_vector_and_tile_paths_give_the_same_bits():
    kernels = _both_paths()
    projection = _projection(1536, 576, seed=2)
    for count in (1, 2, 5, 16, 33, 100):
        rows = _rows(count, 576, seed=count)
        tiles, vector = (k(rows, projection.packed, projection.scale, projection.minimum) for k in kernels)
        assert torch.equal(tiles, vector)


def test_a_rows_products_do_not_depend_on_the_rows_beside_it():
    projection = _projection(576, 1536, seed=0)
    if projection.kernel is None:
        pytest.skip("no int4 CPU kernel here")
    rows = _rows(100, 1536, seed=3)
    together = projection(rows)
    for index in (0, 15, 16, 57, 99):
        assert torch.equal(projection(rows[index : index + 1]), together[index : index + 1])
    assert torch.equal(projection(rows[7:]), together[7:])
    assert torch.equal(projection(rows[:3]), together[:3])


def test_packing_keeps_every_code():
    codes = torch.randint(0, 16, (128, 96), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    packed = int4_cpu.Int4Kernel.pack(codes)
    assert packed.shape == (128, 48)
    assert torch.equal(int4_cpu.Int4Kernel.unpack(packed), codes)


def test_a_shape_the_kernel_cannot_block_stays_on_torchs_kernel():
    _kernel_or_skip()
    projection = _projection(48, 64, seed=5)
    assert projection.kernel is None
    rows = _rows(2, 64, seed=5)
    exact = rows.double() @ projection.dequantized().double().t()
    assert _relative(projection(rows), exact) < 1e-2


def test_the_switches_turn_the_kernel_and_its_tiles_off(fresh_kernel, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_INT4_KERNEL", "0")
    assert int4_cpu.int4_kernel() is None
    assert _projection(576, 576, seed=5).kernel is None
    monkeypatch.delenv("SUPERFLUID_INT4_KERNEL")
    monkeypatch.setenv("SUPERFLUID_AMX", "0")
    int4_cpu.int4_kernel.cache_clear()
    kernel = _kernel_or_skip()
    assert not kernel.tiles
    assert kernel.name == "AVX-512 VNNI"


def test_a_compiler_that_fails_leaves_int4_on_torch_and_says_why(fresh_kernel, monkeypatch, caplog):
    if int4_cpu.VECTOR_CPU_FLAGS - int4_cpu._cpu_flags():
        pytest.skip("the processor check refuses before the compiler runs")
    monkeypatch.setenv("CC", "false")
    with caplog.at_level("INFO", logger="nodeagent.engine.int4_cpu"):
        assert int4_cpu.int4_kernel() is None
    assert "building it failed" in caplog.text
    assert _projection(576, 576, seed=6).kernel is None


def test_the_build_is_cached_by_source(fresh_kernel, tmp_path):
    _kernel_or_skip()
    built = list((tmp_path / "superfluid").glob("int4_cpu-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    int4_cpu.int4_kernel.cache_clear()
    assert int4_cpu.int4_kernel() is not None
    assert built[0].stat().st_mtime_ns == stamp

