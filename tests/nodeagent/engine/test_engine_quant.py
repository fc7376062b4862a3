"""Weights kept quantized (`--weights int8|int4`, and `auto` on a quantized GGUF file): the
kernels against their own dequantized weights, the choice `auto` makes, and the engine's
batching, preemption and prefix cache running on them without changing a token."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from helpers import greedy
from hypothesis import given, settings
from hypothesis import strategies as st
from tinymodel import TINY

from nodeagent.daemon import ModelLoadError
from nodeagent.engine import cpu_kernels, quant
from nodeagent.engine import model as model_module
from nodeagent.engine.builtin import DictSource, random_tensors
from nodeagent.engine.checkpoint import write_gguf
from nodeagent.engine.choices import WeightFormat
from nodeagent.engine.gguf_file import GGUFSource, load_gguf, projection_bits
from nodeagent.engine.kvpool import KVPool
from nodeagent.engine.linear import Linear
from nodeagent.engine.model import LlamaModel
from nodeagent.engine.quant import WeightFormatError, choose_format
from nodeagent.engine.scheduler import Batch, attention_kernels, forward_batch
from nodeagent.engine.torch_engine import TorchDaemon

CPU = torch.device("cpu")
KERNELS = quant.kernel_speedups()
needs_int4 = pytest.mark.skipif(WeightFormat.INT4 not in KERNELS, reason="this torch has no working int4 CPU kernel")
needs_int8 = pytest.mark.skipif(WeightFormat.INT8 not in KERNELS, reason="this torch has no working int8 CPU kernel")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def product_error(linear, x: torch.Tensor) -> float:
    """How far the kernel's x @ W.T is from the fp32 product with its own dequantized weight,
    against the size of the terms summed (a sum that cancels to near zero is no worse)."""
    weight = linear.dequantized()
    scale = F.linear(x.abs(), weight.abs())
    return float(((linear(x) - F.linear(x, weight)).abs() / scale.clamp(min=1e-12)).max())


# ---- the codes -----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), groups=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_a_weight_on_a_16_level_grid_per_group_comes_back_exactly_from_int4(rows, groups, seed):
    """As every GGUF Q4_1 block is: codes 0..15 spanning the group, a scale and a minimum."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, groups, quant.GROUP), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = torch.rand(rows, groups, 1, generator=g) * 0.01 + 1e-4
    low = torch.randn(rows, groups, 1, generator=g) * 0.05
    weight = (codes * scale + low).reshape(rows, -1)
    got_codes, got_scale, got_low = quant.int4_groups(weight)
    rebuilt = got_codes.reshape(rows, groups, -1) * got_scale[..., None] + got_low[..., None]
    assert torch.allclose(rebuilt.reshape(rows, -1), weight, rtol=0, atol=1e-6)
    assert int(got_codes.min()) >= 0 and int(got_codes.max()) <= 15


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 20), groups=st.integers(1, 4), first=st.integers(0, 13), seed=st.integers(0, 2**16))
def test_a_group_on_a_grid_of_fewer_codes_keeps_them(rows, groups, first, seed):
    """As a GGUF Q4_K sub-block often is: its codes a part of 0..15 (two of them neighbours), so
    the group's range is fewer than 15 steps; re-rounding it to 15 steps would move most weights."""
    g = torch.Generator().manual_seed(seed)
    last = torch.randint(first + 1, 16, (1,), generator=g).item()
    codes = torch.randint(first, last + 1, (rows, groups, quant.GROUP), generator=g)
    codes[..., 0], codes[..., 1], codes[..., 2] = first, first + 1, last
    scale = torch.rand(rows, groups, 1, generator=g) * 0.01 + 1e-4
    low = torch.randn(rows, groups, 1, generator=g) * 0.05
    weight = (codes * scale - low).reshape(rows, -1)
    got_codes, got_scale, got_low = quant.int4_groups(weight)
    rebuilt = got_codes.reshape(rows, groups, -1) * got_scale[..., None] + got_low[..., None]
    assert torch.allclose(rebuilt.reshape(rows, -1), weight, rtol=0, atol=1e-6)


def test_q4_k_blocks_keep_their_codes_and_float_weights_take_fifteen_steps():
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize
    from gguf_fixtures import k_quant_blocks

    blocks = k_quant_blocks(Q.Q4_K, 64, 512, seed=3)
    weight = torch.from_numpy(dequantize(blocks.blocks, Q.Q4_K)).reshape(64, 512)
    codes, scale, low = quant.int4_groups(weight)
    rebuilt = codes.reshape(64, -1, quant.GROUP) * scale[..., None] + low[..., None]
    assert float((rebuilt.reshape(64, -1) - weight).abs().max()) <= 1e-6 * float(weight.abs().max())
    floats = torch.randn(64, 16, quant.GROUP, generator=torch.Generator().manual_seed(1))
    assert bool((quant.grid_steps(floats, floats.amin(-1), floats.amax(-1)) == 15).all())


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 30), columns=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_int8_rows_are_within_half_a_step_of_the_weight(rows, columns, seed):
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))
    codes, scale = quant.int8_rows(weight)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= 127
    assert bool(((codes.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-6).all())


# ---- the kernels ---------------------------------------------------------------------------


@needs_int4
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (112, 160), (960, 576)])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_int4_kernel_multiplies_by_its_dequantized_weight(shape, batch):
    torch.manual_seed(batch)
    weight = torch.randn(*shape) * 0.05
    linear = quant.Int4Linear(weight)
    x = torch.randn(batch, 2, shape[1])
    assert linear(x).shape == (batch, 2, shape[0])
    assert product_error(linear, x) < quant.KERNEL_TOLERANCE
    bias = torch.randn(shape[0])
    assert torch.allclose(quant.Int4Linear(weight, bias)(x), linear(x) + bias)
    assert relative_error(linear.dequantized(), weight) < 0.15, "int4 of a gaussian weight: about 9 %"


needs_unpacking = pytest.mark.skipif(
    quant.int4_unpack_width() is None, reason="the int4 kernel's layout is unknown here, or oneDNN lacks bf16"
)


@needs_int4
def _steps(model: LlamaModel, stacked: bool, monkeypatch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three lanes prefilled in one padded chunk, then two decode steps, the last with two lanes:
    each step's hidden states, and the pool they wrote."""
    if not stacked:
        monkeypatch.setattr(model, "layer_stack", lambda: None)
    pool = KVPool(TINY.n_layers, TINY.n_kv_heads, TINY.head_dim, 12, torch.float32, CPU)
    pool.zero(list(range(13)))
    arange, blocks = torch.arange(64), torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    lengths, out = [37, 5, 20], []
    prompts = torch.tensor([[(7 * i + 3 * b) % TINY.vocab_size for i in range(37)] for b in range(3)])
    steps = [(prompts, torch.tensor(lengths), torch.zeros(3, dtype=torch.long), blocks),
             (torch.tensor([[9], [8], [7]]), torch.ones(3, dtype=torch.long), torch.tensor(lengths), blocks),
             (torch.tensor([[6], [5]]), torch.ones(2, dtype=torch.long), torch.tensor([38, 21]), blocks[[0, 2]])]
    with torch.inference_mode():
        for tokens, counts, starts, table in steps:
            batch = Batch(tokens, counts, starts, table, torch.tensor([], dtype=torch.long))
            out.append(forward_batch(model, pool, arange, batch, attention_kernels(model, pool)))
    monkeypatch.undo()
    return out, pool.kv.clone()


@pytest.mark.parametrize("weights", [WeightFormat.INT4, WeightFormat.INT8])
@pytest.mark.parametrize("window", [None, 6])
def test_the_layers_in_one_kernel_call_give_the_bits_of_their_calls_one_by_one(weights, window, monkeypatch):
    config = dataclasses.replace(TINY, sliding_window=window)
    model = LlamaModel.from_source(config, DictSource(random_tensors(config, seed=4, std=0.1)), torch.float32, CPU,
                                   weights)
    if model.layer_stack() is None:
        pytest.skip("the node's CPU kernels do not run here")
    (stacked, stacked_pool), (apart, apart_pool) = (_steps(model, s, monkeypatch) for s in (True, False))
    assert all(torch.equal(a, b) for a, b in zip(stacked, apart, strict=True))
    assert torch.equal(stacked_pool, apart_pool)


def _prefilled(model: LlamaModel, seed: int) -> torch.Tensor:
    """A 40-token prompt prefilled on its own pool: the hidden state at its last token."""
    return _prefill_of(model, torch.randint(0, TINY.vocab_size, (1, 40), generator=torch.Generator().manual_seed(seed)))


def _prefill_of(model: LlamaModel, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [1,N] (N <= 48) prefilled as the scheduler runs a step: the hidden state at the last."""
    n = tokens.shape[1]
    pool = KVPool(TINY.n_layers, TINY.n_kv_heads, TINY.head_dim, 4, torch.float32, CPU)
    pool.zero(list(range(5)))  # as the scheduler hands blocks out: a key past a row's own is 0, not garbage
    batch = Batch(tokens, torch.tensor([n]), torch.tensor([0]), torch.tensor([[0, 1, 2]]), torch.tensor([]))
    with torch.inference_mode():
        return forward_batch(model, pool, torch.arange(64), batch, attention_kernels(model, pool))


@pytest.mark.parametrize("weights", [WeightFormat.INT4, WeightFormat.INT8])
@pytest.mark.parametrize("window", [None, 6])
def test_a_cache_free_pass_gives_every_split_the_bits_of_the_nodes_own_prefill(weights, window, monkeypatch):
    """`run_causal`, which stage forwards run, attends on scratch blocks of its own: through the
    stack (in one call or a layer at a time in chunks of rows) or layer by layer, whole or split
    at any layer, it gives the last position the bits a prefill gives it, and stays near SDPA's."""
    config = dataclasses.replace(TINY, sliding_window=window)
    model = LlamaModel.from_source(config, DictSource(random_tensors(config, seed=5, std=0.1)), torch.float32, CPU,
                                   weights)
    if model.layer_stack() is None:
        pytest.skip("the node's CPU kernels do not run here")
    tokens = torch.tensor([[(11 * i + 5) % TINY.vocab_size for i in range(37)]])
    with torch.inference_mode():
        x = model.embed(tokens)
        given = x.clone()
        whole = model.run_causal(x, 0, TINY.n_layers)
        splits = [model.run_causal(model.run_causal(x, 0, k), k, TINY.n_layers) for k in range(TINY.n_layers + 1)]
        monkeypatch.setattr(model_module, "CAUSAL_CHUNK", 8)
        chunked = model.run_causal(x, 0, TINY.n_layers)
        chunked_split = model.run_causal(model.run_causal(x, 0, 1), 1, TINY.n_layers)
        monkeypatch.setattr(model, "layer_stack", lambda: None)
        apart = model.run_causal(x, 0, TINY.n_layers)
        monkeypatch.setattr(model_module, "attending_kernels", lambda *_: None)
        masked = model.run_causal(x, 0, TINY.n_layers)
    monkeypatch.undo()
    assert torch.equal(x, given)
    assert torch.equal(whole[0, -1], _prefill_of(model, tokens)[0])
    assert all(torch.equal(split, whole) for split in splits)
    assert torch.equal(chunked, whole) and torch.equal(chunked_split, whole)
    assert torch.equal(apart, whole)
    assert not torch.equal(masked, whole)  # SDPA sums in another order
    assert float((masked - whole).abs().max()) < 1e-3 * float(whole.abs().max())  # the activations' rounding


def test_steps_through_the_layer_stack_from_many_threads_at_once_each_get_their_own(int4_model):
    if int4_model.layer_stack() is None:
        pytest.skip("the node's CPU kernels do not run here")
    alone = [_prefilled(int4_model, seed) for seed in range(6)]
    together: dict[int, list[torch.Tensor]] = {}
    threads = [threading.Thread(target=lambda s=seed: together.update({s: [_prefilled(int4_model, s)
                                                                           for _ in range(8)]}))
               for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(torch.equal(got, alone[seed]) for seed in range(6) for got in together[seed])


def test_the_layer_stack_refuses_rows_and_rotations_it_cannot_read(int4_model):
    stack = int4_model.layer_stack()
    if stack is None:
        pytest.skip("the node's CPU kernels do not run here")
    x, rotary = torch.zeros(2, 1, TINY.hidden_size), torch.ones(2, 1, 1, TINY.head_dim // 2, dtype=torch.complex64)
    lanes = (torch.zeros(2, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long),
             torch.ones(2, dtype=torch.long))
    pool = torch.zeros(1)
    with pytest.raises(ValueError, match="fp32 rows"):
        stack(x.double(), rotary, pool, *lanes)
    with pytest.raises(ValueError, match="fp32 rows"):
        stack(torch.zeros(2, 1, TINY.hidden_size + 32), rotary, pool, *lanes)
    with pytest.raises(ValueError, match="fp32 rows"):
        stack(x.view(2, -1), rotary.view(2, 1, -1), pool, *lanes)  # one rotation a row, but no [B,C] of rows
    with pytest.raises(ValueError, match="one contiguous complex64 rotation for each row"):
        stack(x, rotary[:1], pool, *lanes)


def test_the_layers_run_apart_where_a_tensor_parallel_sum_comes_between(int4_model):
    if int4_model.layer_stack() is None:
        pytest.skip("the node's CPU kernels do not run here")
    int4_model.reduce = lambda partial: partial
    try:
        assert int4_model.layer_stack() is None
    finally:
        int4_model.reduce = None


def test_a_projection_with_a_bias_keeps_the_layers_apart():
    if cpu_kernels.cpu_kernels() is None:
        pytest.skip("the node's CPU kernels do not run here")
    tensors = random_tensors(TINY, seed=4, std=0.1, qkv_bias=True)
    model = LlamaModel.from_source(TINY, DictSource(tensors), torch.float32, CPU, WeightFormat.INT4)
    assert model.layer_stack() is None


@needs_unpacking
@pytest.mark.usefixtures("torchs_kernels")  # unpacking is for torch's int4 kernel
@pytest.mark.parametrize("shape", [(64, 32), (192, 96), (960, 576)])
def test_an_unpacked_int4_weight_is_the_kernels_own_weight(shape):
    linear = quant.Int4Linear(torch.randn(*shape) * 0.05)
    linear.unpack_prefill()
    assert linear.unpack_width is not None
    assert torch.equal(linear.unpacked_t().t().float(), linear.dequantized())


@needs_int4
@needs_unpacking
@pytest.mark.usefixtures("torchs_kernels")  # unpacking is for torch's int4 kernel
@pytest.mark.parametrize("rows", [quant.UNPACK_ROWS - 1, quant.UNPACK_ROWS, 77, 300])
def test_long_chunks_run_unpacked_within_bf16_of_the_kernel_and_short_ones_on_it(rows):
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(192, 96) * 0.05, torch.randn(192), torch.randn(rows, 96)
    kernel, unpacked = quant.Int4Linear(weight, bias), quant.Int4Linear(weight, bias)
    unpacked.unpack_prefill()
    if rows < quant.UNPACK_ROWS:
        assert torch.equal(unpacked(x), kernel(x))
    else:
        assert not torch.equal(unpacked(x), kernel(x)), "the GEMM sums in another order than the kernel"
        assert relative_error(unpacked(x), kernel(x)) < quant.KERNEL_TOLERANCE


@needs_int4
@needs_unpacking
@pytest.mark.usefixtures("torchs_kernels")  # unpacking is for torch's int4 kernel
def test_a_weight_unpacked_in_slices_is_the_whole_weight(monkeypatch):
    width = quant.int4_unpack_width()
    linear = quant.Int4Linear(torch.randn(5 * width, 96) * 0.05)
    linear.unpack_prefill()
    x = torch.randn(quant.UNPACK_ROWS + 3, 96)
    whole = linear(x)
    monkeypatch.setattr(quant, "UNPACK_SLICE_BYTES", 2 * 96 * 2 * width)  # slices of 2, 2 and 1 blocks
    assert [end - start for start, end in linear._slices()] == [2 * width, 2 * width, width]
    slices = [linear.unpacked_t(start, end) for start, end in linear._slices()]
    assert torch.equal(torch.cat(slices, 1), linear.unpacked_t())
    assert torch.allclose(linear(x), whole, rtol=1e-2, atol=1e-3)


@needs_int4
@needs_unpacking
@pytest.mark.usefixtures("torchs_kernels")  # unpacking is for torch's int4 kernel
def test_a_weight_whose_rows_do_not_fill_the_layouts_blocks_stays_on_the_kernel():
    weight, x = torch.randn(quant.int4_unpack_width() + 16, 64), torch.randn(quant.UNPACK_ROWS, 64)
    linear = quant.Int4Linear(weight)
    linear.unpack_prefill()
    assert linear.unpack_width is None
    assert torch.equal(linear(x), quant.Int4Linear(weight)(x))


@needs_int8
@pytest.mark.parametrize("shape", [(1, 16), (7, 32), (100, 64), (257, 144)])
@pytest.mark.parametrize("batch", [1, 5])
def test_the_int8_kernel_multiplies_by_its_dequantized_weight(shape, batch):
    torch.manual_seed(batch)
    weight = torch.randn(*shape) * 0.05
    linear = quant.Int8Linear(weight)
    x = torch.randn(batch, shape[1])
    assert product_error(linear, x) < quant.KERNEL_TOLERANCE
    assert relative_error(linear.dequantized(), weight) < 0.02


def test_an_int4_weight_of_a_shape_the_kernel_cannot_tile_is_refused_or_held_as_int8():
    with pytest.raises(WeightFormatError, match="multiple of 16"):
        quant.Int4Linear(torch.randn(20, 64))
    assert isinstance(quant.quantized_linear(WeightFormat.INT4, torch.randn(20, 64)), quant.Int8Linear)
    assert isinstance(quant.quantized_linear(WeightFormat.INT4, torch.randn(32, 48)), quant.Int8Linear)
    with pytest.raises(WeightFormatError, match="multiple of 16"):
        quant.Int8Linear(torch.randn(5, 33))
    assert isinstance(quant.quantized_linear(WeightFormat.INT8, torch.randn(5, 33)), Linear)


@needs_int8
@pytest.mark.parametrize(("outputs", "inputs"), [(1000, 64), (1024, 64), (1024, 576)])  # torch's kernel, the node's
@pytest.mark.parametrize("greedy", [False, True])
def test_the_int8_heads_top_logits_are_exact_fp32_products(outputs, inputs, greedy):
    """The kernel rounds to bf16; the refined top is the fp32 product of the same int8 weight,
    so two tokens a hundredth apart keep their order."""
    weight = torch.randn(outputs, inputs)
    head = quant.Int8Head(weight)
    x = torch.randn(3, inputs)
    want = F.linear(x, head.dequantized())
    got = head(x, greedy=greedy)
    top = want.topk(4, dim=-1).indices  # well inside the refined 16, whatever bf16 did to the 16th
    assert torch.allclose(got.gather(1, top), want.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert got.dtype == torch.float32


# ---- auto ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("speedups", "bits", "want"),
    [
        ({WeightFormat.INT4: 0.3, WeightFormat.INT8: 0.5}, 4, WeightFormat.INT4),
        ({WeightFormat.INT4: 0.95, WeightFormat.INT8: 0.5}, 4, WeightFormat.INT8),
        ({WeightFormat.INT4: 0.3, WeightFormat.INT8: 0.5}, 8, WeightFormat.INT8),
        ({WeightFormat.INT4: 0.3, WeightFormat.INT8: 1.2}, 8, WeightFormat.FLOAT),
        ({}, 4, WeightFormat.FLOAT),
        ({WeightFormat.INT4: 0.3, WeightFormat.INT8: 0.5}, None, WeightFormat.FLOAT),
    ],
)
def test_auto_keeps_the_files_bits_only_with_a_kernel_faster_than_float(monkeypatch, speedups, bits, want):
    monkeypatch.setattr(quant, "kernel_speedups", lambda: speedups)
    chosen = choose_format(WeightFormat.AUTO, CPU, bits)
    assert chosen.format == want
    share = speedups.get(chosen.format)
    assert chosen.format == WeightFormat.FLOAT or share <= quant.AUTO_MAX_TIME_SHARE


def test_a_quantized_format_asked_for_where_it_cannot_run_is_refused(monkeypatch):
    with pytest.raises(WeightFormatError, match="CPU only"):
        choose_format(WeightFormat.INT4, torch.device("cuda"), 4)
    assert choose_format(WeightFormat.AUTO, torch.device("cuda"), 4).format == WeightFormat.FLOAT
    monkeypatch.setattr(quant, "kernel_speedups", lambda: {})
    with pytest.raises(WeightFormatError, match="lacks a working int8"):
        choose_format(WeightFormat.INT8, CPU, None)


def test_a_gguf_files_projection_bits_are_the_fewest_its_quantized_layer_matrices_keep(tmp_path):
    config = dataclasses.replace(TINY, hidden_size=64, intermediate_size=128)
    tensors = random_tensors(config, seed=3)
    layer_weights = [n for n in tensors if n.startswith("model.layers.") and n.endswith("proj.weight")]
    for qtype, bits in ((Q.Q4_0, 4), (Q.Q8_0, 8), (Q.F32, None)):
        path = write_gguf(tmp_path / f"{qtype.name}.gguf", config, tensors, dict.fromkeys(layer_weights, qtype))
        assert projection_bits(path) == bits
    mostly_wide = {**dict.fromkeys(layer_weights, Q.Q5_0), layer_weights[0]: Q.Q4_0, layer_weights[1]: Q.F16}
    assert projection_bits(write_gguf(tmp_path / "mixed.gguf", config, tensors, mostly_wide)) == 4


# ---- the engine on quantized weights -------------------------------------------------------


@pytest.fixture(scope="module")
def int4_model():
    if WeightFormat.INT4 not in KERNELS:
        pytest.skip("this torch has no working int4 CPU kernel")
    tensors = random_tensors(TINY, seed=11, std=0.1)
    return LlamaModel.from_source(TINY, DictSource(tensors), torch.float32, CPU, WeightFormat.INT4)


def causal_greedy(model: LlamaModel, prompt: list[int], n: int) -> list[int]:
    """The model's own greedy continuation, recomputed cache-free for every token."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            x = model.run_causal(model.embed(torch.tensor([tokens])), 0, model.config.n_layers)
            tokens.append(int(model.logits(x[0, -1]).argmax()))
    return tokens[len(prompt) :]


def in_threads(daemon: TorchDaemon, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = greedy(daemon, prompts[i], lengths[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return [results[i] for i in range(len(prompts))]


PROMPTS = [[7], [1, 2, 3, 4, 5], list(range(10, 37)), [200, 13, 13, 99, 5], list(range(100, 140)), [3, 250, 17],
           [9] * 20, [60, 61]]
LENGTHS = [12, 30, 5, 20, 9, 25, 16, 3]  # lanes end at different steps, so the batch shrinks


def test_eight_lanes_of_int4_weights_give_each_lanes_cache_free_greedy_tokens(int4_model):
    daemon = TorchDaemon(int4_model, "tiny", max_batch=8, kv_blocks=256)
    try:
        got = in_threads(daemon, PROMPTS, LENGTHS)
    finally:
        daemon.close()
    assert got == [causal_greedy(int4_model, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    assert "int4" in daemon.summary()


def test_a_preempted_int4_lane_resumes_to_the_same_tokens(int4_model):
    daemon = TorchDaemon(int4_model, "tiny", max_batch=2, kv_blocks=16)  # one full window
    try:
        long_prompts = [list(range(20, 60)), list(range(70, 110))]
        got = in_threads(daemon, long_prompts, [150, 150])
        assert daemon._scheduler.preemptions >= 1
    finally:
        daemon.close()
    assert got == [causal_greedy(int4_model, p, 150) for p in long_prompts]


def test_a_prefix_cache_hit_on_int4_weights_changes_no_token(int4_model):
    daemon = TorchDaemon(int4_model, "tiny", max_batch=1, kv_blocks=64)
    try:
        first = greedy(daemon, list(range(30, 70)), 10)
        again = greedy(daemon, list(range(30, 70)) + first + [5, 6], 10)
        assert daemon._scheduler.reused_tokens >= 32
    finally:
        daemon.close()
    assert again == causal_greedy(int4_model, list(range(30, 70)) + first + [5, 6], 10)


@needs_unpacking
@pytest.mark.usefixtures("torchs_kernels")  # unpacking is for torch's int4 kernel
def test_fast_prefill_changes_a_long_prompts_logits_only_within_bf16():
    tensors = random_tensors(TINY, seed=11, std=0.1)
    models = [LlamaModel.from_source(TINY, DictSource(tensors), torch.float32, CPU, WeightFormat.INT4) for _ in "ab"]
    assert models[1].unpack_prefill()
    tokens = torch.tensor([list(range(7, 7 + 2 * quant.UNPACK_ROWS))])
    with torch.inference_mode():
        kernel, fast = (m.logits(m.run_causal(m.embed(tokens), 0, TINY.n_layers)) for m in models)
    assert not torch.equal(kernel, fast)
    assert float((kernel - fast).abs().max()) < 0.05 * float(kernel.abs().max())
    assert float((kernel.argmax(-1) == fast.argmax(-1)).float().mean()) >= 0.95


def test_quantized_weights_hold_a_fraction_of_the_float_bytes(int4_model):
    tensors = random_tensors(TINY, seed=11, std=0.1)
    floats = LlamaModel.from_source(TINY, DictSource(tensors), torch.float32, CPU)
    assert int4_model.weight_bytes() < floats.weight_bytes() / 3


def test_a_quantized_gguf_loads_quantized_under_auto_and_names_why(tmp_path):
    if WeightFormat.INT4 not in KERNELS and WeightFormat.INT8 not in KERNELS:
        pytest.skip("no quantized CPU kernel in this torch")
    config = dataclasses.replace(TINY, hidden_size=64, intermediate_size=128, vocab_size=256)
    tensors = random_tensors(config, seed=3)
    names = [n for n in tensors if n.endswith("proj.weight")]
    path = write_gguf(tmp_path / "q8.gguf", config, tensors, dict.fromkeys(names, Q.Q8_0))
    chosen = choose_format(WeightFormat.AUTO, CPU, projection_bits(path))
    daemon = TorchDaemon.load(str(path), device="cpu", max_batch=1, kv_budget_mb=1)
    try:
        assert f"{chosen.format} ({chosen.reason}" in daemon.summary()
        float_model = load_gguf(path, torch.float32, CPU)
        assert daemon.model.weight_bytes() <= float_model.weight_bytes()
    finally:
        daemon.close()


@needs_int4
def test_each_ggml_type_takes_the_format_that_holds_it_and_the_serving_line_says_so(tmp_path):
    """A Q4_K_M-like file: its Q4_K matrices int4 with their codes kept, its Q5_K and Q6_K ones
    int8 (more than 4 bits), the Q4_K weights within the fp16 scales' rounding of the file's."""
    from gguf_fixtures import k_quant_tensors

    config = dataclasses.replace(TINY, hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=256)
    tensors = k_quant_tensors(config, random_tensors(config, seed=3), seed=5)
    path = write_gguf(tmp_path / "k.gguf", config, tensors, {})
    daemon = TorchDaemon.load(str(path), device="cpu", max_batch=1, kv_budget_mb=1, weights="int4")
    try:
        line = daemon.summary()
        assert "F32 x15 as int4 re-rounded, Q4_K x2 as int4, Q5_K x2 as int8 re-rounded, Q6_K x2 as int8 re-rounded" \
            in line, line
        layers = daemon.model.layers
        assert isinstance(layers[0].gate_up, quant.Int4Linear) and isinstance(layers[0].down, quant.Int8Linear)
        source = GGUFSource(path)
        up = source.get("model.layers.0.mlp.up_proj.weight", (config.intermediate_size, config.hidden_size))
        source.close()
        held = layers[0].gate_up.dequantized()[config.intermediate_size:]
        assert float((held - up).abs().max()) <= 2 ** -10 * float(up.abs().max())
    finally:
        daemon.close()


@needs_int4
@needs_unpacking
@pytest.mark.usefixtures("torchs_kernels")  # unpacking is for torch's int4 kernel
def test_the_serving_line_says_whether_fast_prefill_took(caplog):
    fast = TorchDaemon.load("builtin", device="cpu", weights="int4", fast_prefill=True, kv_budget_mb=8)
    try:
        assert "int4 (as asked; fast prefill)" in fast.summary()
    finally:
        fast.close()
    plain = TorchDaemon.load("builtin", device="cpu", weights="float", fast_prefill=True, kv_budget_mb=8)
    try:
        assert "fast prefill" not in plain.summary()
        assert "prefill stays on the int4 kernel" in caplog.text
    finally:
        plain.close()


def test_an_unknown_weights_format_fails_the_load_by_name():
    with pytest.raises(ModelLoadError, match="int3"):
        TorchDaemon.load("builtin", device="cpu", weights="int3")


def test_the_serving_line_names_the_node_kernels_and_fast_prefill_leaves_them(caplog):
    kernels = cpu_kernels.cpu_kernels()
    if kernels is None:
        pytest.skip("no node CPU kernels here")
    with caplog.at_level("INFO", logger="nodeagent.engine.torch_engine"):
        daemon = TorchDaemon.load("builtin", device="cpu", weights="int4", fast_prefill=True, kv_budget_mb=8)
    try:
        assert f"int4 (as asked; node kernels on {kernels.name})" in daemon.summary()
        assert "the node's CPU kernels already run prefill chunks fast and exactly" in caplog.text
    finally:
        daemon.close()
