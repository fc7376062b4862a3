"""Greedy tokens of the batched, paged engine equal a naive reference, token for token.

The reference below is written independently of `nodeagent.engine.model`: unfused weights,
one head at a time, the whole sequence recomputed for every token, in float64.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import types

import numpy as np
import pytest
import torch
from tinymodel import TINY

from nodeagent.daemon import GenExtras
from nodeagent.engine import linear
from nodeagent.engine.builtin import DictSource, random_tensors
from nodeagent.engine.model import LlamaModel, ModelConfig
from nodeagent.engine.torch_engine import TorchDaemon
from proto.params import GenParams

NEW_TOKENS = 64
WINDOW = 12
PROMPTS = [
    [7],
    [1, 2, 3, 4, 5],
    list(range(10, 27)),
    [200, 13, 13, 13, 99, 5, 77, 31],
    list(range(100, 140)),
    [3, 250, 17],
    list(range(50, 82)),
    [42] * 20,
]


def reference_greedy(tensors: dict, c: ModelConfig, prompt: list[int], n: int) -> list[int]:
    t = {k: v.double() for k, v in tensors.items()}
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(reference_logits(t, c, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def is_reference_greedy(tensors: dict, c: ModelConfig, prompt: list[int], tokens: list[int]) -> bool:
    """Whether `tokens` are the reference's greedy continuation of `prompt`, checked in one
    pass: the causal reference's logits at each position depend on nothing after it, so every
    token must be the argmax of the logits before it."""
    t = {k: v.double() for k, v in tensors.items()}
    logits = reference_logits(t, c, list(prompt) + list(tokens[:-1]))
    return logits[len(prompt) - 1 :].argmax(-1).tolist() == list(tokens)


def reference_logits(t: dict, c: ModelConfig, tokens: list[int]) -> torch.Tensor:
    n, hd = len(tokens), c.head_dim
    x = t["model.embed_tokens.weight"][tokens]
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if c.rope_scaling and c.rope_scaling["rope_type"] == "linear":
        inv_freq = inv_freq / c.rope_scaling["factor"]
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def rope(v: torch.Tensor) -> torch.Tensor:
        a, b = v[..., : hd // 2], v[..., hd // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def norm(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * v / torch.sqrt((v * v).mean(-1, keepdim=True) + c.rms_norm_eps)

    def proj(h: torch.Tensor, name: str) -> torch.Tensor:
        out = h @ t[name + ".weight"].T
        return out + t[name + ".bias"] if name + ".bias" in t else out

    future = torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), diagonal=1)
    if c.sliding_window is not None:  # a position sees itself and the window - 1 before it
        future += torch.tril(torch.full((n, n), float("-inf"), dtype=torch.float64), diagonal=-c.sliding_window)
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        h = norm(x, t[p + "input_layernorm.weight"])
        q = rope(proj(h, p + "self_attn.q_proj").view(n, c.n_heads, hd))
        k = rope(proj(h, p + "self_attn.k_proj").view(n, c.n_kv_heads, hd))
        v = proj(h, p + "self_attn.v_proj").view(n, c.n_kv_heads, hd)
        heads = []
        for head in range(c.n_heads):
            kv = head // (c.n_heads // c.n_kv_heads)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(hd) + future
            heads.append(torch.softmax(scores, dim=-1) @ v[:, kv])
        x = x + proj(torch.cat(heads, dim=-1), p + "self_attn.o_proj")
        h = norm(x, t[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(h @ t[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    head_weight = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return norm(x, t["model.norm.weight"]) @ head_weight.T


VARIANTS = {
    "llama": (TINY, {}),
    "qwen2-bias-tied": (dataclasses.replace(TINY, tie_word_embeddings=True), {"qkv_bias": True}),
    "linear-rope-mha": (
        dataclasses.replace(TINY, n_kv_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        {},
    ),
    # A window far shorter than the prompts and the 64 tokens after them, so most positions
    # attend past it; the chunked-prefill variant (7) puts chunk edges inside the window.
    "mistral-sliding-window": (dataclasses.replace(TINY, sliding_window=WINDOW), {}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request):
    config, extra = VARIANTS[request.param]
    tensors = random_tensors(config, seed=11, std=0.1, **extra)
    expected = [reference_greedy(tensors, config, p, NEW_TOKENS) for p in PROMPTS]
    return config, tensors, expected


def make_daemon(config: ModelConfig, tensors: dict, max_batch: int, **kwargs) -> TorchDaemon:
    """An fp32 pool unless told otherwise, as the float64 reference needs for token parity."""
    model = LlamaModel.from_source(config, DictSource(tensors), torch.float32, torch.device("cpu"))
    return TorchDaemon(model, "tiny", max_batch=max_batch, kv_blocks=256, **{"kv_dtype": torch.float32, **kwargs})


def generate_all(daemon: TorchDaemon, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt at once, one caller thread each, as the node agent calls."""
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = daemon.generate_tokens_streaming(
            prompts[i], GenParams(), NEW_TOKENS, 0, GenExtras(), lambda batch: True
        ).tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_the_sliding_window_changes_the_tokens_it_is_checked_on():
    """Without this, the window variant could pass with the window ignored."""
    config, _ = VARIANTS["mistral-sliding-window"]
    tensors = random_tensors(config, seed=11, std=0.1)
    full = dataclasses.replace(config, sliding_window=None)
    windowed = [reference_greedy(tensors, config, p, NEW_TOKENS) for p in PROMPTS[4:6]]
    assert windowed != [reference_greedy(tensors, full, p, NEW_TOKENS) for p in PROMPTS[4:6]]


def test_one_lane_matches_reference(variant):
    config, tensors, expected = variant
    daemon = make_daemon(config, tensors, max_batch=1)
    try:
        assert generate_all(daemon, PROMPTS) == expected
    finally:
        daemon.close()


@pytest.mark.parametrize("lanes,prefill_chunk", [(3, 512), (8, 512), (8, 7)])
def test_batched_lanes_match_reference(variant, lanes, prefill_chunk):
    config, tensors, expected = variant
    daemon = make_daemon(config, tensors, max_batch=lanes, prefill_chunk=prefill_chunk)
    try:
        assert generate_all(daemon, PROMPTS) == expected
        assert daemon.sched_stats().pool_blocks_used == 0
    finally:
        daemon.close()


def test_stage_splits_match_whole_forward(variant):
    config, tensors, expected = variant
    daemon = make_daemon(config, tensors, max_batch=1)
    try:
        for prompt, tokens in zip(PROMPTS[:4], expected):
            whole = daemon.forward_stage(prompt, 0, config.n_layers, None)
            assert whole.token == tokens[0]
            for k in range(config.n_layers):
                first = daemon.forward_stage(prompt, 0, k, None)
                second = daemon.forward_stage([], k, config.n_layers, first.data)
                assert second == whole, f"split at layer {k}"
    finally:
        daemon.close()


def test_portable_path_matches_reference(variant, monkeypatch):
    """The path CUDA takes (plain `F.linear`, no oneDNN packing) gives the same tokens."""
    monkeypatch.setattr(linear, "can_pack", lambda device, dtype: False)
    config, tensors, expected = variant
    daemon = make_daemon(config, tensors, max_batch=8)
    try:
        assert not daemon.model.lm_head.packed
        assert generate_all(daemon, PROMPTS) == expected
    finally:
        daemon.close()


def test_bfloat16_path_tracks_float32(variant):
    """bf16, as served on CUDA, runs the non-fp32 rotary path; its logits stay near fp32's."""
    config, tensors, expected = variant
    daemons = [
        TorchDaemon(
            LlamaModel.from_source(config, DictSource(tensors), dtype, torch.device("cpu")),
            "tiny",
            max_batch=2,
            kv_blocks=64,
        )
        for dtype in (torch.float32, torch.bfloat16)
    ]
    try:
        hidden = [
            np.frombuffer(d.forward_stage(PROMPTS[2], 0, config.n_layers - 1, None).data, dtype="<f4")
            for d in daemons
        ]
        assert np.abs(hidden[0] - hidden[1]).max() < 0.05 * np.abs(hidden[0]).max()
        assert daemons[1].forward_stage(PROMPTS[2], 0, config.n_layers, None).token == expected[2][0]
        assert len(generate_all(daemons[1], PROMPTS[:2])[0]) == NEW_TOKENS
    finally:
        for d in daemons:
            d.close()


def test_a_torch_without_the_private_onednn_ops_falls_back_to_f_linear(monkeypatch):
    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace())
    linear.onednn_linear_works.cache_clear()
    try:
        layer = linear.Linear(torch.arange(6.0).reshape(2, 3))
        assert not layer.packed
        assert layer(torch.ones(1, 3)).tolist() == [[3.0, 12.0]]
    finally:
        monkeypatch.undo()
        linear.onednn_linear_works.cache_clear()
    assert linear.Linear(torch.ones(2, 3)).packed, "with the ops back, the packed path returns"
