"""The node's CPU kernels (int4 and int8 in groups of 32): their products, the same bits on the
vector and tile paths and on the AVX-512 and AVX2 builds whatever rows run beside a row, and how
the node falls back where they cannot run."""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import subprocess
import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from polling import wait_until

from nodeagent.engine import cpu_kernels
from nodeagent.engine.quant import (
    Int4Linear,
    Int8Linear,
    gated_projection,
    normed_projection,
    residual_projection,
    rotated_projection,
)
from nodeagent.engine.rope import inv_frequencies, rope_table, rotate_in_place

#: Activations keep 12 bits against their group's largest, so products stay near 2^-11.
TOLERANCE = 2e-3
FORMATS = [Int4Linear, Int8Linear]


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """`cpu_kernels` worked out again, building into an empty cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_kernels.cpu_kernels.cache_clear()
    yield
    cpu_kernels.cpu_kernels.cache_clear()


@pytest.fixture(params=[build.name for build in cpu_kernels.BUILDS])
def each_build(request, monkeypatch):
    """The projections made in the test run on each build of the kernels this processor runs."""
    build = _build(request.param)
    if not cpu_kernels.runnable(build):
        pytest.skip(f"this processor cannot run the {build.name} build")
    monkeypatch.setenv("SUPERFLUID_CPU_KERNELS", build.name)
    cpu_kernels.cpu_kernels.cache_clear()
    yield build
    cpu_kernels.cpu_kernels.cache_clear()


def _kernels_or_skip() -> cpu_kernels.CpuKernels:
    kernels = cpu_kernels.cpu_kernels()
    if kernels is None:
        pytest.skip("no node CPU kernels here: " + (cpu_kernels._builds_for_here()[1] or "they failed to load"))
    return kernels


def _build(name: str) -> cpu_kernels.Build:
    build = cpu_kernels.named_build(name)
    assert build is not None
    return build


def _loaded_or_skip(build: cpu_kernels.Build) -> cpu_kernels.CpuKernels:
    kernels = cpu_kernels.load(build) if cpu_kernels.runnable(build) else "the processor cannot run it"
    if isinstance(kernels, str):
        pytest.skip(f"no {build.name} build here: {kernels}")
    return kernels


def _projection(kind, rows: int, columns: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    projection = kind(torch.randn(rows, columns, generator=generator) * 0.05)
    if projection.kernels is None:
        pytest.skip("no node CPU kernels here")
    return projection


def _rows(count: int, columns: int, seed: int) -> torch.Tensor:
    """Activations with an outlier channel, as real models have."""
    rows = torch.randn(count, columns, generator=torch.Generator().manual_seed(seed))
    rows[:, 5] *= 40
    return rows


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).norm(dim=1) / want.norm(dim=1)).max())


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 32), (192, 576), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("count", [1, 3, 4, 17, 130])
def test_a_kernel_multiplies_by_its_weight_with_activations_kept_to_12_bits(
    kind, out_features, in_features, count, each_build
):
    projection = _projection(kind, out_features, in_features, seed=count)
    assert projection.kernels.build == each_build
    rows = _rows(count, in_features, seed=1)
    exact = rows.double() @ projection.dequantized().double().t()
    in_bf16 = rows.to(torch.bfloat16).double() @ projection.dequantized().double().t()
    assert _relative(projection(rows), exact) < TOLERANCE
    if in_features > 32:  # beside an outlier in a row's only group, bf16's own 8 bits do better
        assert _relative(projection(rows), exact) < _relative(in_bf16, exact) / 1.5


@pytest.mark.parametrize("kind", FORMATS)
def test_the_vector_and_tile_paths_give_the_same_bits(kind):
    projection = _projection(kind, 1536, 576, seed=2)
    vector_only = copy.copy(projection.kernels)
    vector_only.tiles = False
    bits = 4 if kind is Int4Linear else 8
    on_vectors = vector_only.bound(bits, *((projection.packed, projection.scales) if bits == 4
                                           else (projection.codes, projection.scales)))
    for count in (1, 2, 5, 16, 33, 100):
        rows = _rows(count, 576, seed=count)
        assert torch.equal(projection(rows), on_vectors(rows))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 32), (1536, 576), (576, 1536)])
def test_the_avx2_build_gives_the_avx512_builds_bits(bits, out_features, in_features):
    """Both builds sum the same exact integers and take the same fp32 steps for each output, so a
    node's tokens do not depend on which processor ran it. Codes span their whole range."""
    wide, narrow = (_loaded_or_skip(build) for build in cpu_kernels.BUILDS)
    generator = torch.Generator().manual_seed(in_features + bits)
    groups = (out_features, in_features // 32)
    scales = [(torch.rand(groups, generator=generator) * 0.01).to(cpu_kernels.SCALE_DTYPE)]
    if bits == 4:
        packed = wide.pack_int4(torch.randint(0, 16, (out_features, in_features), generator=generator))
        scales.append((-torch.rand(groups, generator=generator) * 0.08).to(cpu_kernels.SCALE_DTYPE))
    else:
        codes = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
        packed = wide.pack_int8(codes)
    products = [kernels.bound(bits, packed, wide.pack_scales(*scales)) for kernels in (wide, narrow)]
    norm = torch.rand(in_features, generator=generator) + 0.5
    for count in (1, 2, 3, 4, 5, 17, 130):
        rows = _rows(count, in_features, seed=count)
        freqs, residual = _freqs(count, 32, seed=count), _rows(count, out_features, seed=1)
        turn = cpu_kernels.Epilogue(rotary=freqs.data_ptr(), rotated=out_features // 2, head_dim=32)
        added = cpu_kernels.Epilogue(residual=residual.data_ptr())
        assert torch.equal(*(product(rows) for product in products))
        assert torch.equal(*(product(rows, norm, 1e-5) for product in products))
        assert torch.equal(*(product(rows, norm, 1e-5, turn) for product in products))
        assert torch.equal(*(product(rows * 100, None, 0.0, cpu_kernels.GATED) for product in products))
        assert torch.equal(*(product(rows, None, 0.0, added) for product in products))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("count", [1, 5, 40])
def test_a_norm_taken_into_the_kernel_is_torchs_rms_norm_then_the_product(kind, count):
    projection = _projection(kind, 192, 576, seed=count)
    x = _rows(count, 576, seed=9).view(1, count, 576)
    norm = torch.rand(576, generator=torch.Generator().manual_seed(count)) + 0.5
    fused = normed_projection(projection, x, norm, 1e-5)
    apart = projection(F.rms_norm(x, (576,), norm, 1e-5))
    assert fused.shape == apart.shape == (1, count, 192)
    assert _relative(fused.view(count, -1), apart.view(count, -1).double()) < TOLERANCE
    assert torch.equal(fused[:, -1:], normed_projection(projection, x[:, -1:], norm, 1e-5))


def _freqs(count: int, head_dim: int, seed: int) -> torch.Tensor:
    """Rotations at `count` random positions, [1, count, 1, head_dim / 2], as `LlamaModel.rope`
    gives them."""
    table = rope_table(inv_frequencies(head_dim, 10000.0, None), 4096, torch.device("cpu"))
    return table[torch.randint(0, 4096, (1, count), generator=torch.Generator().manual_seed(seed))].unsqueeze(-2)


def _rotated_apart(projection, x: torch.Tensor, norm: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The product, then its first four heads of 64 turned by torch."""
    apart = normed_projection(projection, x, norm, 1e-5)
    rotate_in_place(apart[..., :256].view(*x.shape[:-1], 4, 64), freqs)
    return apart


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("count", [1, 5, 40])
def test_rotary_positions_taken_into_the_kernel_give_torchs_bits(kind, count, each_build):
    """Four of six heads turned, as q and k are and v is not."""
    projection = _projection(kind, 384, 576, seed=count)
    x = _rows(count, 576, seed=4).view(1, count, 576)
    norm = torch.rand(576, generator=torch.Generator().manual_seed(count)) + 0.5
    freqs = _freqs(count, 64, seed=count)
    fused = rotated_projection(projection, x, norm, 1e-5, freqs, 256, 64)
    assert torch.equal(fused, _rotated_apart(projection, x, norm, freqs))
    assert not torch.equal(fused, normed_projection(projection, x, norm, 1e-5))
    assert torch.equal(fused[:, -1:], rotated_projection(projection, x[:, -1:], norm, 1e-5, freqs[:, -1:], 256, 64))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("count", [1, 5, 40])
def test_the_gated_unit_taken_into_the_kernel_is_silu_of_the_gate_times_up(kind, count, each_build):
    """Gates from near zero to thousands either side, where silu's exponential leaves the range."""
    weight = torch.randn(384, 576, generator=torch.Generator().manual_seed(count)) * 0.05
    weight[:96] *= 1000
    projection = kind(weight)
    x = _rows(count, 576, seed=6).view(1, count, 576)
    norm = torch.rand(576, generator=torch.Generator().manual_seed(count)) + 0.5
    fused = gated_projection(projection, x, norm, 1e-5)
    gate, up = normed_projection(projection, x, norm, 1e-5).double().chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert fused.shape == (1, count, 192)
    assert float(gate.abs().max()) > 200 and float(gate.abs().min()) < 1
    # fp32's own rounding of -gate * log2(e) scales e^gate by up to 1 + 6e-8 |gate|, so far below
    # zero the bound is absolute, against up
    assert ((fused.double() - want).abs() <= 2e-6 * want.abs() + 1e-12 * up.abs()).all()
    assert torch.equal(fused[:, -1:], gated_projection(projection, x[:, -1:], norm, 1e-5))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("count", [1, 5, 40])
def test_a_residual_added_in_the_kernel_gives_torchs_sum(kind, count, each_build):
    projection = _projection(kind, 576, 384, seed=count)
    h, x = _rows(count, 384, seed=7).view(1, count, 384), _rows(count, 576, seed=8).view(1, count, 576)
    fused = residual_projection(projection, h, x)
    assert torch.equal(fused, x + projection(h))
    assert not torch.equal(fused, projection(h))
    assert torch.equal(fused[:, -1:], residual_projection(projection, h[:, -1:], x[:, -1:]))


def test_rotations_broadcast_over_lanes_are_taken_apart_from_the_kernel():
    """The kernel reads one rotation a row; rotations shared by two lanes go through torch."""
    projection = _projection(Int4Linear, 384, 576, seed=1)
    x, norm, freqs = _rows(6, 576, seed=2).view(2, 3, 576), torch.ones(576), _freqs(3, 64, seed=4)
    assert torch.equal(rotated_projection(projection, x, norm, 1e-5, freqs, 256, 64),
                       _rotated_apart(projection, x, norm, freqs))


def test_a_projection_with_a_bias_turns_its_rows_after_the_bias():
    weight = torch.randn(384, 576, generator=torch.Generator().manual_seed(1)) * 0.05
    projection = Int4Linear(weight, torch.randn(384, generator=torch.Generator().manual_seed(2)))
    x = _rows(3, 576, seed=5).view(1, 3, 576)
    norm, freqs = torch.ones(576), _freqs(3, 64, seed=3)
    assert torch.equal(rotated_projection(projection, x, norm, 1e-5, freqs, 256, 64),
                       _rotated_apart(projection, x, norm, freqs))


@pytest.mark.parametrize("kind", FORMATS)
def test_a_rows_products_do_not_depend_on_the_rows_beside_it(kind, each_build):
    projection = _projection(kind, 576, 1536, seed=0)
    rows = _rows(100, 1536, seed=3)
    together = projection(rows)
    for index in (0, 15, 16, 57, 99):
        assert torch.equal(projection(rows[index : index + 1]), together[index : index + 1])
    assert torch.equal(projection(rows[7:]), together[7:])
    assert torch.equal(projection(rows[:3]), together[:3])


@settings(max_examples=30, deadline=None)
@given(tiles=st.integers(1, 4), steps=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_packing_keeps_every_code_and_picks_rows(tiles, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    rows, columns = 16 * tiles, 8 * steps
    outputs = torch.randint(0, rows, (5,), generator=generator)
    nibbles = torch.randint(0, 16, (rows, columns), generator=generator, dtype=torch.uint8)
    packed = cpu_kernels.CpuKernels.pack_int4(nibbles)
    assert packed.numel() == rows * columns // 2
    assert torch.equal(cpu_kernels.CpuKernels.unpack_int4(packed), nibbles)
    assert torch.equal(cpu_kernels.CpuKernels.unpack_int4(packed, outputs), nibbles[outputs])
    bytes_ = torch.randint(-128, 128, (rows, columns), generator=generator, dtype=torch.int8)
    packed = cpu_kernels.CpuKernels.pack_int8(bytes_)
    assert torch.equal(cpu_kernels.CpuKernels.unpack_int8(packed), bytes_)
    assert torch.equal(cpu_kernels.CpuKernels.unpack_int8(packed, outputs), bytes_[outputs])


@pytest.mark.parametrize("kind", FORMATS)
def test_decode_calls_from_many_threads_at_once_each_get_their_own_product(kind, each_build):
    """Decode-sized calls from several threads each run on their own thread's OpenMP team."""
    projection = _projection(kind, 1536, 576, seed=4)
    inputs = [_rows(2, 576, seed=seed) for seed in range(6)]
    want = [projection(rows) for rows in inputs]
    got: dict[int, list[torch.Tensor]] = {}

    def call(index: int) -> None:
        got[index] = [projection(inputs[index]) for _ in range(20)]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(product, want[i]) for i, products in got.items() for product in products)
    assert len(got) == len(inputs)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_forked_child_runs_the_kernels_without_its_parents_threads(kind):
    projection = _projection(kind, 1536, 576, seed=5)
    rows = _rows(1, 576, seed=5)
    want = projection(rows)  # the parent's OpenMP team has its threads now
    child = os.fork()
    if child == 0:
        os._exit(0 if torch.equal(projection(rows), want) else 1)
    assert _exit_code(child, timeout=30.0) == 0


def _exit_code(child: int, timeout: float) -> int | None:
    """The child's exit code, or None where it had not ended within `timeout` (it is killed)."""
    statuses = []

    def ended() -> bool:
        pid, status = os.waitpid(child, os.WNOHANG)
        statuses.append(status)
        return pid == child

    if wait_until(ended, timeout):
        return os.waitstatus_to_exitcode(statuses[-1])
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    return None


def test_a_q8_0_block_comes_back_exactly_from_int8():
    _kernels_or_skip()
    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(-127, 128, (64, 4, 32), generator=generator)
    codes[..., 3] = 127
    scale = (torch.rand(64, 4, 1, generator=generator) * 0.01).half().float()  # fp16, as a block's
    weight = (codes * scale).reshape(64, 128)
    projection = Int8Linear(weight)
    assert projection.kernels is not None
    assert torch.equal(projection.dequantized(), weight)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_shape_the_kernels_cannot_block_stays_on_torchs_kernel(kind):
    _kernels_or_skip()
    projection = kind(torch.randn(48, 64, generator=torch.Generator().manual_seed(5)) * 0.05)
    assert projection.kernels is None
    rows = _rows(2, 64, seed=5)
    exact = rows.double() @ projection.dequantized().double().t()
    assert _relative(projection(rows), exact) < 1e-2


def test_the_switches_turn_the_kernels_and_their_tiles_off(fresh_kernels, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_CPU_KERNELS", "0")
    assert cpu_kernels.cpu_kernels() is None
    assert Int4Linear(torch.randn(576, 576)).kernels is None
    monkeypatch.delenv("SUPERFLUID_CPU_KERNELS")
    monkeypatch.setenv("SUPERFLUID_AMX", "0")
    cpu_kernels.cpu_kernels.cache_clear()
    kernels = _kernels_or_skip()
    assert not kernels.tiles
    assert kernels.name == kernels.build.label


def test_the_switch_picks_the_avx2_build_and_warns_of_a_name_it_does_not_know(fresh_kernels, monkeypatch, caplog):
    avx2 = _build("avx2")
    if not cpu_kernels.runnable(avx2):
        pytest.skip("this processor cannot run the AVX2 build")
    monkeypatch.setenv("SUPERFLUID_CPU_KERNELS", "avx2")
    kernels = _kernels_or_skip()
    assert (kernels.build, kernels.name, kernels.tiles) == (avx2, "AVX2", False)
    monkeypatch.setenv("SUPERFLUID_CPU_KERNELS", "avx-512")
    cpu_kernels.cpu_kernels.cache_clear()
    with caplog.at_level("WARNING", logger="nodeagent.engine.cpu_kernels"):
        best = _kernels_or_skip()
    assert "SUPERFLUID_CPU_KERNELS=avx-512 is none of 0, 1, avx512, avx2" in caplog.text
    assert best.build == next(build for build in cpu_kernels.BUILDS if cpu_kernels.runnable(build))


def test_a_compiler_that_fails_leaves_torchs_kernels_and_says_why(fresh_kernels, monkeypatch, caplog):
    if not any(cpu_kernels.runnable(build) for build in cpu_kernels.BUILDS):
        pytest.skip("the processor check refuses before the compiler runs")
    monkeypatch.setenv("CC", "false")
    with caplog.at_level("INFO", logger="nodeagent.engine.cpu_kernels"):
        assert cpu_kernels.cpu_kernels() is None
    assert "building it failed" in caplog.text
    assert Int8Linear(torch.randn(576, 576)).kernels is None


def test_a_build_that_fails_to_compile_gives_way_to_the_next(fresh_kernels, monkeypatch):
    """An older compiler may lack the AVX-512 build's AMX flags; the AVX2 build then runs."""
    avx2 = _build("avx2")
    if not cpu_kernels.runnable(avx2):
        pytest.skip("this processor cannot run the AVX2 build")
    broken = dataclasses.replace(avx2, name="broken", flags=("-mno-such-flag",))
    monkeypatch.setattr(cpu_kernels, "BUILDS", (broken, avx2))
    assert _kernels_or_skip().build == avx2


@pytest.mark.parametrize("name", [build.name for build in cpu_kernels.BUILDS])
def test_every_build_compiles_whether_or_not_this_processor_runs_it(name):
    """A machine that runs only the AVX2 build still finds out when a change to the shared
    source breaks the AVX-512 one, whose tests skip there."""
    if cpu_kernels._compiler() is None:
        pytest.skip("no C compiler here")
    try:
        library = cpu_kernels._built(_build(name))
    except subprocess.CalledProcessError as e:
        said = e.stderr.decode()
        if "unrecognized" in said and "-m" in said:
            pytest.skip(f"this compiler lacks the {name} build's flags: {said.strip()}")
        raise AssertionError(f"the {name} build failed to compile:\n{said}") from e
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True).stdout
    assert {"sf_int4_mm", "sf_int8_mm", "sf_paged_attention"} <= set(symbols.split())


def test_the_build_is_cached_by_source(fresh_kernels, tmp_path):
    _kernels_or_skip()
    built = list((tmp_path / "superfluid").glob("cpu_kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_kernels.cpu_kernels.cache_clear()
    assert cpu_kernels.cpu_kernels() is not None
    assert built[0].stat().st_mtime_ns == stamp
