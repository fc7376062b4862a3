"""Writing a model in Hugging Face layout, so the loader, the tests and the bench (which hands
the same weights to `transformers`) share one definition of that layout."""

from __future__ import annotations

import json
from pathlib import Path

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
