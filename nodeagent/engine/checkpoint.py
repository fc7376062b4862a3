"""Writing a model in Hugging Face layout or as a GGUF file, so the loaders, the tests and the
bench (which hands the same weights to `transformers`) share one definition of each layout."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from nodeagent.engine.loader import INDEX_FILE
from nodeagent.engine.model import ModelConfig


def hf_config(config: ModelConfig, model_type: str = "llama") -> dict:
    """`config.json` for `config`; `model_type` "qwen2" marks q/k/v biases."""
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    raw = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if config.eos_token_ids:
        ids = list(config.eos_token_ids)
        raw["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    return raw


def write_checkpoint(
    directory: str | Path,
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    shards: int = 1,
    model_type: str = "llama",
) -> Path:
    """Save `tensors` as `shards` safetensors files (with an index when more than one)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(config, model_type), indent=2))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = names[shard::shards]
        save_file({n: tensors[n].contiguous() for n in part}, str(directory / file))
        weight_map.update({n: file for n in part})
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return directory


@dataclass(frozen=True)
class Quantized:
    """Tensor data already in a GGUF block type, for the types the gguf package can read but
    not write (the k-quants): uint8 [rows, bytes per row]."""

    blocks: np.ndarray
    qtype: int


@dataclass(frozen=True)
class GGUFVocab:
    """A byte-level BPE vocabulary (llama.cpp's "gpt2" tokenizer model) and chat template."""

    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    bos_token_id: int
    eos_token_id: int
    chat_template: str | None = None
    pre: str = "default"


def permute_rotary_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: per head, the two rotary halves interleaved."""
    head_dim = rows.shape[0] // n_heads
    per_head = rows.reshape(n_heads, 2, head_dim // 2, *rows.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(rows.shape))


def write_gguf(
    path: str | Path,
    config: ModelConfig,
    tensors: dict[str, torch.Tensor | Quantized],
    types: dict[str, int] | None = None,
    vocab: GGUFVocab | None = None,
    arch: str = "llama",
) -> Path:
    """Save Hugging Face-named `tensors` as a GGUF file of `arch` as llama.cpp's converter
    would: GGUF names, q/k rows permuted (Llama only), each tensor in `types[name]` (default
    F32)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    from nodeagent.engine.families.registry import by_architecture
    from nodeagent.engine.gguf_file import gguf_name

    path = Path(path)
    writer = GGUFWriter(str(path), arch)
    _gguf_metadata(writer, config)
    if vocab is not None:
        _gguf_vocab(writer, vocab)
    for name, tensor in tensors.items():
        if isinstance(tensor, Quantized):
            writer.add_tensor(gguf_name(name), tensor.blocks, raw_dtype=GGMLQuantizationType(tensor.qtype))
            continue
        values = tensor.float().numpy()
        if arch in by_architecture(arch).permuted_architectures and (".q_proj." in name or ".k_proj." in name):
            values = permute_rotary_rows(values, config.n_heads if ".q_proj." in name else config.n_kv_heads)
        qtype = GGMLQuantizationType((types or {}).get(name, GGMLQuantizationType.F32))
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), values)
        else:
            writer.add_tensor(gguf_name(name), quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_metadata(writer, c: ModelConfig) -> None:
    writer.add_block_count(c.n_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)


def _gguf_vocab(writer, vocab: GGUFVocab) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_merges(vocab.merges)
    writer.add_token_types(vocab.token_types)
    writer.add_bos_token_id(vocab.bos_token_id)
    writer.add_eos_token_id(vocab.eos_token_id)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)
