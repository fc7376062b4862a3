"""A 1B-shaped Llama with random weights as a GGUF file, for the llama.cpp bench.

The shape is Llama 3.2 1B's (2048 hidden, 16 layers, 32 heads over 8 KV heads, 8192 MLP, tied
embeddings) with SmolLM2's tokenizer copied in, since llama.cpp refuses a file without a
vocabulary; its 49,152 tokens make it 1.07B parameters. Written once per type into the bench
cache with the `gguf` package's writer and quantizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from proto.models import ALIASES, alias_path

HIDDEN, LAYERS, HEADS, KV_HEADS, MLP = 2048, 16, 32, 8, 8192
HEAD_DIM = HIDDEN // HEADS
SEED = 1
TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
)


def write_1b(directory: Path, qtype_name: str) -> Path:
    """The file for `qtype_name` (Q4_0, Q8_0), written if not yet there."""
    path = directory / f"llama-1b-shaped-{qtype_name}.gguf"
    if path.exists():
        return path
    print(f"writing {path.name} (once; a few minutes)", flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    qtype = GGMLQuantizationType[qtype_name]
    vocab = _copy_tokenizer_and_count(writer := GGUFWriter(str(path) + ".part", "llama"))
    _add_config(writer, vocab)
    rng = np.random.default_rng(SEED)
    writer.add_tensor("token_embd.weight", _quantized(rng, (vocab, HIDDEN), qtype), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    kv = KV_HEADS * HEAD_DIM
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (MLP, HIDDEN), "ffn_up": (MLP, HIDDEN),
              "ffn_down": (HIDDEN, MLP)}
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", _quantized(rng, shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(path) + ".part").rename(path)
    return path


def _quantized(rng: np.random.Generator, shape: tuple[int, int], qtype: GGMLQuantizationType) -> np.ndarray:
    return quantize(rng.standard_normal(shape, dtype=np.float32) * 0.02, qtype)


def _add_config(writer: GGUFWriter, vocab: int) -> None:
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(MLP)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(vocab)


def _copy_tokenizer_and_count(writer: GGUFWriter) -> int:
    """SmolLM2's tokenizer fields into `writer`; returns its vocabulary size."""
    reader = GGUFReader(str(alias_path(ALIASES["smollm2-135m-instruct"])))
    vocab = 0
    for key in TOKENIZER_KEYS:
        field = reader.fields.get(key)
        if field is None:
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, value)
            if key == "tokenizer.ggml.tokens":
                vocab = len(value)
        elif kind == GGUFValueType.STRING:
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, int(value))
    return vocab
