"""GGUF files the test writes with the `gguf` writer: our engine reads them as `transformers`
does (`gguf_file=`), in every tensor type, and refuses what it cannot run by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import k_quant_tensors, mixed_types, train_vocab
from tinymodel import TINY

from nodeagent.daemon import GenExtras, ModelLoadError
from nodeagent.engine.builtin import random_tensors
from nodeagent.engine.checkpoint import write_gguf
from nodeagent.engine.gguf_file import load_gguf
from nodeagent.engine.model import ModelConfig
from nodeagent.engine.torch_engine import TorchDaemon
from proto.params import GenParams

transformers = pytest.importorskip("transformers")

VOCAB = train_vocab()
#: The tiny model four times as wide, so each weight row holds whole k-quant blocks (256
#: weights), over the trained vocabulary and its end token; tied, as small GGUF models are.
CONFIG = dataclasses.replace(
    TINY,
    vocab_size=len(VOCAB.tokens),
    hidden_size=256,
    intermediate_size=512,
    head_dim=64,
    tie_word_embeddings=True,
    eos_token_ids=(VOCAB.eos_token_id,),
)
PROMPT = [5, 17, 33, 2, 90, 120, 7, 300, 64]
NEW_TOKENS = 24
CPU = torch.device("cpu")


def tensors_of(kind: str, config: ModelConfig) -> tuple[dict, dict]:
    tensors = random_tensors(config, seed=11, std=0.08)
    if kind == "f32":
        return tensors, {}
    if kind == "mixed":
        return tensors, mixed_types(config)
    return k_quant_tensors(config, tensors, seed=5), {}


def theirs(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def their_tokens(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(VOCAB.eos_token_id)] if VOCAB.eos_token_id in tokens else tokens


def our_tokens(path, prompt: list[int], n: int) -> list[int]:
    daemon = TorchDaemon.load(str(path), device="cpu", max_batch=1, kv_budget_mb=4, weights="float")
    try:
        return daemon.generate_tokens_streaming(prompt, GenParams(), n, 0, GenExtras(), lambda b: True).tokens
    finally:
        daemon.close()


def assert_matches_transformers(path):
    """Our model and transformers' on the GGUF at `path`: logits over PROMPT within 1e-4 and
    the same greedy tokens. Returns both models."""
    ours = load_gguf(path, torch.float32, CPU)
    reference = theirs(path)
    with torch.inference_mode():
        x = ours.run_causal(ours.embed(torch.tensor([PROMPT])), 0, ours.config.n_layers)
        diff = (ours.logits(x[0]) - reference(torch.tensor([PROMPT])).logits[0].float()).abs().max()
    assert float(diff) <= 1e-4
    assert our_tokens(path, PROMPT, NEW_TOKENS) == their_tokens(reference, PROMPT, NEW_TOKENS)
    return ours, reference


@pytest.mark.parametrize("kind,tied", [("f32", True), ("mixed", False), ("k_quants", True)])
def test_gguf_matches_transformers_on_the_same_file(tmp_path, kind, tied):
    """Logits within 1e-4 and the same greedy tokens: both dequantize with gguf, so quantized
    types must agree as closely as float ones; the q/k un-permutation is checked by both."""
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    tensors, types = tensors_of(kind, config)
    path = write_gguf(tmp_path / f"tiny-{kind}.gguf", config, tensors, types, VOCAB)
    ours, _ = assert_matches_transformers(path)
    assert ours.config.tie_word_embeddings == tied


def test_qwen2_gguf_with_qkv_biases_matches_transformers(tmp_path):
    """Qwen2: q/k/v biases and no q/k permutation in llama.cpp's files."""
    tensors = random_tensors(CONFIG, seed=4, std=0.08, qkv_bias=True)
    path = write_gguf(tmp_path / "tiny-qwen2.gguf", CONFIG, tensors, mixed_types(CONFIG), VOCAB, arch="qwen2")
    _, reference = assert_matches_transformers(path)
    assert type(reference).__name__ == "Qwen2ForCausalLM"


def test_the_file_is_unmapped_once_loaded(tmp_path):
    path = write_gguf(tmp_path / "unmapped.gguf", CONFIG, random_tensors(CONFIG, seed=2), {}, VOCAB)
    model = load_gguf(path, torch.float32, CPU)
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read()
    assert model.config.vocab_size == len(VOCAB.tokens)


def test_config_and_end_tokens_come_from_the_metadata(tmp_path):
    path = write_gguf(tmp_path / "meta.gguf", CONFIG, random_tensors(CONFIG, seed=2), {}, VOCAB)
    config = load_gguf(path, torch.float32, CPU).config
    assert config.rms_norm_eps == pytest.approx(CONFIG.rms_norm_eps)  # stored as float32
    assert dataclasses.replace(config, rms_norm_eps=CONFIG.rms_norm_eps) == CONFIG


def _rewrite(path, arch: str = "llama", drop: str | None = None, extra: str | None = None, as_i32: str | None = None):
    """A copy of the GGUF at `path` with another architecture, a tensor less, one more, or one
    stored as I32 (a type gguf cannot dequantize)."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(str(path))
    out = path.with_name("changed.gguf")
    writer = GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("llama."):
            value = field.contents()
            name = key.replace("llama.", f"{arch}.", 1)
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(name, value)
    for t in reader.tensors:
        if t.name == as_i32:
            writer.add_tensor(t.name, np.array(t.data).astype(np.int32), raw_dtype=Q.I32)
        elif t.name != drop:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    if extra:
        writer.add_tensor(extra, np.zeros(CONFIG.hidden_size, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize(
    "change,message",
    [
        ({"arch": "gemma"}, "GGUF architecture 'gemma' is not a decoder this engine runs"),
        ({"drop": "blk.1.ffn_up.weight"}, "lacks tensor 'blk.1.ffn_up.weight'"),
        ({"extra": "blk.0.ffn_down.bias"}, "tensors this engine does not use: blk.0.ffn_down.bias"),
        ({"extra": "rope_freqs.weight"}, "rope divisors for 512 rotary dimensions, not 64"),
        ({"as_i32": "blk.0.attn_norm.weight"}, "'blk.0.attn_norm.weight' has type I32, which cannot be dequantized"),
    ],
)
def test_unsupported_gguf_is_a_load_error_naming_it(tmp_path, change, message):
    path = write_gguf(tmp_path / "base.gguf", CONFIG, random_tensors(CONFIG, seed=2), {})
    with pytest.raises(ModelLoadError) as caught:
        load_gguf(_rewrite(path, **change), torch.float32, CPU)
    assert message in str(caught.value)


def test_a_file_that_is_no_gguf_is_a_load_error(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="is not a readable GGUF file"):
        load_gguf(path, torch.float32, CPU)
