"""1B-shaped Qwen3 and Gemma 3 files with random weights, written by llama.cpp's own tools, for
the llama.cpp bench: a Hugging Face checkpoint in bf16 (transformers' config, its tensor names
and shapes taken from the model built on the meta device), `convert_hf_to_gguf.py` to F16, then
`llama-quantize` to Q4_K_M, the most downloaded type. Each is written once into the bench cache.

Shapes: Qwen3 at Qwen3-1.7B's width (2048 hidden, 16 query heads over 8 KV heads of 128, 6144
MLP, 151,936 tokens, tied) with 16 layers, 1.1B parameters; Gemma 3 1B as released (1152
hidden, 26 layers, 4 query heads over 1 KV head of 256, 6912 MLP, 262,144 tokens, a 512-token
window on 5 layers of 6), 1.0B. Gemma's 1152 columns are no multiple of the k-quants' 256, so
llama-quantize keeps those matrices in its fallback types, as in the files people download.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamacpp_tree import convert, write_sentencepiece  # noqa: E402

SHAPES = {
    "qwen3": ("Qwen3Config", {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 16,
                              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                              "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 40960,
                              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}),
    "gemma3": ("Gemma3TextConfig", {"hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
                                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                                    "vocab_size": 262144, "sliding_window": 512, "query_pre_attn_scalar": 256,
                                    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}),
}
STD = 0.02
SHARD_BYTES = 2 << 30


def write_family_1b(directory: Path, family: str, tools: Path, qtype: str = "Q4_K_M") -> Path:
    """The `qtype` file of `family`'s 1B shape, written if not yet there."""
    path = directory / f"{family}-1b-shaped-{qtype}.gguf"
    if path.exists():
        return path
    print(f"writing {path.name} with llama.cpp's converter and quantizer (once; several minutes)", flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        checkpoint = Path(tmp) / family
        _random_checkpoint(checkpoint, family)
        f16 = convert(checkpoint, Path(tmp) / f"{family}-f16.gguf", outtype="f16")
        part = path.with_suffix(".part")
        subprocess.run([str(tools / "llama-quantize"), str(f16), str(part), qtype], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        part.rename(path)
    return path


def _random_checkpoint(directory: Path, family: str) -> None:
    """transformers' config and tensor names for `family`, random bf16 weights (norms around 1,
    Gemma's around 0 for its 1 + w), in shards with an index, and a small tokenizer."""
    import transformers
    from safetensors.torch import save_file

    config_class, shape = SHAPES[family]
    config = getattr(transformers, config_class)(**shape, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    directory.mkdir(parents=True)
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(directory))
    generator = torch.Generator().manual_seed(1)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files = 0

    def flush() -> None:
        nonlocal files, shard
        files += 1
        name = f"model-{files:05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard = {}

    for name, param in model.named_parameters():
        values = torch.randn(param.shape, generator=generator) * STD
        if name.endswith("norm.weight") and family != "gemma3":
            values += 1.0
        shard[name] = values.to(torch.bfloat16)
        if sum(t.numel() * 2 for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    write_sentencepiece(directory, 60)
