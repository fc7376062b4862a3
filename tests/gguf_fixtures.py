"""Small GGUF files the tests write themselves: random Llama weights in several tensor types and
a byte-level BPE vocabulary trained on a few sentences, with a ChatML chat template."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from tinymodel import TINY

from nodeagent.engine.checkpoint import GGUFVocab, Quantized
from nodeagent.engine.model import ModelConfig

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "What is the capital of France? It is Paris, of course!",
    "Hello there, how are you today? I am fine, thank you.",
    "Numbers like 12345 and 2026 are split into digits: 7 8 9.",
] * 4
#: Offsets of the fp16 scales in each block of the k-quants written from random bytes, and a
#: scale that keeps the weights small.
K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
K_SCALE = np.float16(2e-5)


def config_for(size: int) -> ModelConfig:
    """The tiny model around a vocabulary of `size` tokens, one layer deep (the codec tests need
    the file, not the weights)."""
    return dataclasses.replace(TINY, vocab_size=size, n_layers=1)


def train_vocab(size: int = 320) -> GGUFVocab:
    """A byte-level BPE trained with `tokenizers` and written the way llama.cpp stores it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    saved = json.loads(tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in saved]
    types = [3 if t in SPECIAL else 1 for t in tokens]
    return GGUFVocab(
        tokens=tokens,
        merges=merges,
        token_types=types,
        bos_token_id=vocab["<|im_start|>"],
        eos_token_id=vocab["<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
    )


def k_quant_blocks(qtype: int, rows: int, columns: int, seed: int) -> Quantized:
    """Random k-quant blocks with small scales (gguf can read these types but not write them)."""
    block, size = GGML_QUANT_SIZES[Q(qtype)]
    data = np.random.default_rng(seed).integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[Q(qtype)]:
        data[:, :, offset : offset + 2] = np.frombuffer(K_SCALE.tobytes(), dtype=np.uint8)
    return Quantized(data.reshape(rows, -1), int(qtype))


def mixed_types(config: ModelConfig) -> dict[str, int]:
    """Every float and writable quantized type somewhere in the model (norms stay F32)."""
    cycle = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj"]
    types = {"model.embed_tokens.weight": Q.Q8_0}
    for i in range(config.n_layers):
        for j, name in enumerate(names):
            types[f"model.layers.{i}.{name}.weight"] = cycle[(i + j) % len(cycle)]
    return types


def k_quant_tensors(config: ModelConfig, tensors: dict, seed: int) -> dict:
    """`tensors` with the MLP's up and down projections in Q4_K, Q5_K and Q6_K blocks."""
    kinds = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
    out = dict(tensors)
    for i in range(config.n_layers):
        up, down = f"model.layers.{i}.mlp.up_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"
        out[up] = k_quant_blocks(kinds[i % 3], config.intermediate_size, config.hidden_size, seed + i)
        out[down] = k_quant_blocks(kinds[(i + 1) % 3], config.hidden_size, config.intermediate_size, seed - i)
    return out


CONFIG_FOR_VOCAB = config_for(len(train_vocab().tokens))
