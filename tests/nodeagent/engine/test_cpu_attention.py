"""The CPU attention kernel over the paged KV pool: exact attention to each lane's own keys, the
same bits for a row whichever chunk, batch or build computes it, and where the node keeps SDPA."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.engine import cpu_kernels
from nodeagent.engine.kvpool import BLOCK_TOKENS, KVPool, blocks_for
from nodeagent.engine.cpu_kernels import attending_kernels

#: fp32 sums of a few hundred terms against float64's.
TOLERANCE = 1e-5
KV_HEADS = 2


@dataclass
class Lane:
    """A lane's tokens: queries [N,H,hd] and keys/values [N,2,KV,hd] at positions 0..N-1, and
    the pool blocks they live in."""

    q: torch.Tensor
    kv: torch.Tensor
    blocks: list[int]


def _kernels(build_name: str | None = None) -> cpu_kernels.CpuKernels:
    build = cpu_kernels.named_build(build_name) if build_name else None
    if build is not None:
        if not cpu_kernels.runnable(build):
            pytest.skip(f"this processor cannot run the {build.name} build")
        kernels = cpu_kernels.load(build)
        if isinstance(kernels, str):
            pytest.skip(kernels)
        return kernels
    found = cpu_kernels.cpu_kernels()
    if found is None:
        pytest.skip("no node CPU kernels here")
    return found


def _lanes(pool: KVPool, lengths: list[int], group: int, head_dim: int, seed: int) -> list[Lane]:
    """Random lanes, their blocks taken from the pool in a shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(pool.total, generator=generator).tolist()
    lanes = []
    for n in lengths:
        blocks = [order.pop() for _ in range(blocks_for(n))]
        q = torch.randn(n, KV_HEADS * group, head_dim, generator=generator)
        kv = torch.randn(n, 2, KV_HEADS, head_dim, generator=generator)
        lanes.append(Lane(q, kv, blocks))
    return lanes


def _slots(lane: Lane, positions: range) -> list[int]:
    return [lane.blocks[p // BLOCK_TOKENS] * BLOCK_TOKENS + p % BLOCK_TOKENS for p in positions]


def _step(kernels, pool: KVPool, lanes: list[Lane], starts: list[int], counts: list[int], window: int):
    """One kernel call: lane b's rows starts[b]..starts[b]+counts[b]-1, padded to the widest."""
    width, n_blocks = max(counts), max(len(lane.blocks) for lane in lanes)
    heads, head_dim = lanes[0].q.shape[1:]
    q = torch.zeros(len(lanes), width, heads, head_dim)
    kv = torch.zeros(len(lanes), width, 2, KV_HEADS, head_dim)
    slots = torch.full((len(lanes), width), pool.scratch_slot)
    for b, (lane, start, count) in enumerate(zip(lanes, starts, counts, strict=True)):
        q[b, :count] = lane.q[start : start + count]
        kv[b, :count] = lane.kv[start : start + count]
        slots[b, :count] = torch.tensor(_slots(lane, range(start, start + count)))
    table = torch.tensor([lane.blocks + [pool.scratch_block] * (n_blocks - len(lane.blocks)) for lane in lanes])
    return kernels.attention(pool.kv[0], q, kv, slots.reshape(-1), table, torch.tensor(starts),
                             torch.tensor(counts), window)


def _exact(lane: Lane, position: int, window: int, stored: torch.dtype = torch.float32) -> torch.Tensor:
    """The attention output [H*hd] of `lane`'s row at `position`, in float64, with its keys and
    values as a pool of `stored` holds them."""
    first = max(0, position - window + 1) if window else 0
    heads, head_dim = lane.q.shape[1:]
    q = lane.q[position].double().view(KV_HEADS, heads // KV_HEADS, head_dim)
    keys, values = (lane.kv[first : position + 1, i].to(stored).double().transpose(0, 1) for i in range(2))
    weights = torch.softmax(q @ keys.transpose(1, 2) / head_dim**0.5, dim=-1)
    return (weights @ values).reshape(-1)


#: What the kernel's pool may hold.
STORED = [torch.float32, torch.float16]


def _pool(head_dim: int, n_blocks: int = 24, dtype: torch.dtype = torch.float32) -> KVPool:
    pool = KVPool(1, KV_HEADS, head_dim, n_blocks, dtype, torch.device("cpu"))
    pool.kv.fill_(float("nan"))
    pool.zero(list(range(n_blocks + 1)))
    return pool


def _store_context(pool: KVPool, lane: Lane, until: int) -> None:
    """Positions before `until` written as the torch path writes them."""
    if until:
        pool.write(0, torch.tensor(_slots(lane, range(until))), lane.kv[:until])


@pytest.mark.parametrize("stored", STORED)
@pytest.mark.parametrize("build", [build.name for build in cpu_kernels.BUILDS])
@settings(max_examples=25, deadline=None)
@given(
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([16, 64, 128]),
    shapes=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 40)), min_size=1, max_size=3),
    window=st.sampled_from([0, 1, 17, 50]),
    seed=st.integers(0, 2**16),
)
def test_each_row_attends_exactly_to_its_own_lanes_keys(build, stored, group, head_dim, shapes, window, seed):
    """Against float64 over the keys and values as the pool holds them (an fp16 pool rounds the
    step's new ones as the torch path's writes round the context's)."""
    kernels = _kernels(build)
    pool = _pool(head_dim, dtype=stored)
    lanes = _lanes(pool, [start + count for start, count in shapes], group, head_dim, seed)
    for lane, (start, _) in zip(lanes, shapes, strict=True):
        _store_context(pool, lane, start)
    starts, counts = [s for s, _ in shapes], [c for _, c in shapes]
    out = _step(kernels, pool, lanes, starts, counts, window)
    for b, (lane, start, count) in enumerate(zip(lanes, starts, counts, strict=True)):
        for i in range(count):
            want = _exact(lane, start + i, window, stored)
            assert float((out[b, i].double() - want).abs().max()) < TOLERANCE * max(1.0, float(want.abs().max()))
        assert not out[b, count:].any(), "padding rows give 0"


@settings(max_examples=20, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 79), max_size=6).map(lambda c: sorted(set(c))),
    other=st.integers(1, 30),
    window=st.sampled_from([0, 23]),
    seed=st.integers(0, 2**16),
    stored=st.sampled_from(STORED),
)
def test_a_row_gives_the_same_bits_whichever_chunk_and_batch_compute_it(cuts, other, window, seed, stored):
    """A prompt prefilled at once, or in chunks beside another lane, down to one token a step:
    each row's output is the same to the bit, so decoding after a prefill (or a preemption's
    recompute, or a prefix-cache hit) goes on exactly as one pass would."""
    kernels = _kernels()
    pool = _pool(64, dtype=stored)
    lane, neighbour = _lanes(pool, [80, other], 3, 64, seed)
    whole = _step(kernels, pool, [lane], [0], [80], window)[0]
    pool.zero(list(range(pool.total)))
    edges = [0, *cuts, 80]
    pieces = []
    for start, end in zip(edges, edges[1:], strict=False):
        pieces.append(_step(kernels, pool, [neighbour, lane], [0, start], [other, end - start], window)[1])
        pieces[-1] = pieces[-1][: end - start]
    assert torch.equal(torch.cat(pieces), whole)


@pytest.mark.parametrize("stored", STORED)
@pytest.mark.parametrize("build", [build.name for build in cpu_kernels.BUILDS])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
def test_a_decode_steps_narrow_tile_gives_the_bits_of_a_prefills_wide_one(build, group, stored):
    """A step of one token a lane has only its G heads' rows, which take the kernel's narrow
    tile where G is at most half a tile; a prefill's rows take the wide one."""
    kernels = _kernels(build)
    pool = _pool(64, dtype=stored)
    lane, neighbour = _lanes(pool, [37, 37], group, 64, seed=group)
    whole = _step(kernels, pool, [lane], [0], [37], 0)[0]
    pool.zero(list(range(pool.total)))
    one_by_one = torch.cat([_step(kernels, pool, [neighbour, lane], [p, p], [1, 1], 0)[1] for p in range(37)])
    assert torch.equal(one_by_one, whole)


def test_the_kernel_refuses_a_pool_laid_out_otherwise():
    kernels = _kernels()
    pool = _pool(64)
    lane = _lanes(pool, [3], 1, 64, seed=1)[0]
    blocks_first = pool.kv[0].permute(2, 0, 1, 3, 4).contiguous().permute(1, 2, 0, 3, 4)
    with pytest.raises(ValueError, match="laid out"):
        kernels.attention(blocks_first, lane.q[None], lane.kv[None], torch.tensor(_slots(lane, range(3))),
                          torch.tensor([lane.blocks]), torch.tensor([0]), torch.tensor([3]), 0)


@pytest.mark.parametrize("stored", STORED)
def test_the_avx512_and_avx2_builds_give_the_same_bits(stored):
    builds = [_kernels(build.name) for build in cpu_kernels.BUILDS]
    outputs = []
    for kernels in builds:
        pool = _pool(64, dtype=stored)
        lanes = _lanes(pool, [70, 33], 4, 64, seed=5)
        _store_context(pool, lanes[1], 20)
        outputs.append(_step(kernels, pool, lanes, [0, 20], [70, 13], 0))
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("stored", STORED)
def test_the_torch_path_reads_back_what_it_wrote_in_token_order(stored):
    pool = _pool(32, dtype=stored)
    lane = _lanes(pool, [40], 1, 32, seed=3)[0]
    _store_context(pool, lane, 40)
    keys, values = pool.read(0, torch.tensor([lane.blocks]))
    assert torch.equal(keys[0, :, :40], lane.kv[:, 0].transpose(0, 1).to(stored))
    assert torch.equal(values[0, :, :40], lane.kv[:, 1].transpose(0, 1).to(stored))


def test_an_fp16_pool_holds_what_the_torch_path_would_have_written():
    """The kernel rounds a step's new keys and values to fp16 as torch does (to nearest, ties to
    even), so a pool written by either path holds the same bits."""
    kernels = _kernels()
    by_kernel, by_torch = _pool(64, dtype=torch.float16), _pool(64, dtype=torch.float16)
    lane = _lanes(by_kernel, [40], 3, 64, seed=9)[0]
    lane.kv[0, 0, 0, :4] = torch.tensor([65504.0, 1e-8, 2.0**-24 * 1.5, 1.0 + 2.0**-11])  # edges and a tie
    _step(kernels, by_kernel, [lane], [0], [40], 0)
    _store_context(by_torch, lane, 40)
    assert torch.equal(by_kernel.kv, by_torch.kv)


@pytest.mark.parametrize(
    ("head_dim", "model_dtype", "dtype", "kernels_env", "in_place"),
    [
        (64, torch.float32, torch.float32, "1", True),
        (64, torch.float32, torch.float16, "1", True),
        (8, torch.float32, torch.float32, "1", False),
        (272, torch.float32, torch.float32, "1", False),
        (64, torch.float32, torch.bfloat16, "1", False),
        (64, torch.float16, torch.float16, "1", False),
        (64, torch.float32, torch.float32, "0", False),
    ],
)
def test_the_kernel_attends_where_it_takes_the_pool_else_sdpa_does(head_dim, model_dtype, dtype, kernels_env,
                                                                   in_place, monkeypatch):
    """An fp32 model on the CPU over an fp32 or fp16 pool; its queries and new keys are fp32."""
    monkeypatch.setenv("SUPERFLUID_CPU_KERNELS", kernels_env)
    cpu_kernels.cpu_kernels.cache_clear()
    try:
        if in_place:
            _kernels()
        pool = KVPool(1, KV_HEADS, head_dim, 2, dtype, torch.device("cpu"))
        assert (attending_kernels(pool.kv.device, model_dtype, head_dim, pool.kv.dtype) is not None) == in_place
    finally:
        cpu_kernels.cpu_kernels.cache_clear()


def _read_right(t: torch.Tensor, stride: int) -> bool:
    """Whether each token's part is contiguous and token (b, c) at (b * C + c) * stride."""
    batch, chunk = t.shape[:2]
    return all(
        t[b, c].is_contiguous() and t[b, c].data_ptr() == t.data_ptr() + (b * chunk + c) * stride * t.element_size()
        for b in range(batch)
        for c in range(chunk)
    )


@settings(max_examples=300, deadline=None)
@given(
    shape=st.tuples(*(st.integers(1, 4) for _ in range(4))),
    extra=st.integers(0, 3),
    order=st.permutations(range(4)),
)
def test_token_rows_copies_exactly_the_layouts_the_kernel_cannot_read(shape, extra, order):
    """Tokens sliced out of wider rows (q out of qkv) and permuted views go in as they are where
    the kernel reads them right at some stride, and as a copy otherwise."""
    wide = torch.arange(float(torch.Size(shape).numel() // shape[3] * (shape[3] + extra)))
    base = wide.view(*shape[:3], shape[3] + extra)[..., : shape[3]]
    permuted = base.permute(*order).contiguous().permute(*sorted(range(4), key=lambda i: order[i]))
    for t in (base, permuted):
        rows, stride = cpu_kernels._token_rows(t)
        assert torch.equal(rows, t)
        assert _read_right(rows, stride)
        readable = any(_read_right(t, s) for s in range(1, t.numel() + 8))
        assert (rows.data_ptr() == t.data_ptr()) == readable
