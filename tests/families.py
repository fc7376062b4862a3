"""Small random checkpoints of every decoder family, written by `transformers` itself: odd
sizes, grouped-query attention, a window shorter than the prompts and each family's own options
switched on, so a test compares our engine with the reference on the same weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

#: Longer than every case's window and than Phi-3's original context (its long factors apply).
PROMPT = [5, 17, 33, 2, 90, 12, 7, 9, 64, 11, 3, 19, 44, 81, 2, 9, 60, 35, 71, 28, 13, 50, 66, 4]
VOCAB = 97
WINDOW = 5
#: The shape every case starts from: odd widths, 6 query heads over 2 KV heads.
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 72,
    "intermediate_size": 100,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


@dataclass(frozen=True)
class Case:
    """A family's checkpoint: transformers' config class and what it switches on."""

    config_class: str
    options: dict = field(default_factory=dict)
    #: llama.cpp's GGUF architecture, where its converter writes one we read.
    arch: str | None = None


CASES = {
    "llama3.1": Case("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                     "rope_theta": 500.0}, "llama"),
    "llama-yarn": Case("LlamaConfig", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 32}}),
    "mistral": Case("MistralConfig", {"sliding_window": WINDOW}),
    "qwen2-window-layers": Case("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW,
                                                "max_window_layers": 2}),
    "qwen3": Case("Qwen3Config", {"tie_word_embeddings": True}, "qwen3"),
    "gemma2": Case("Gemma2Config", {"tie_word_embeddings": True, "sliding_window": WINDOW,
                                    "query_pre_attn_scalar": 12, "attn_logit_softcapping": 3.0,
                                    "final_logit_softcapping": 2.0}, "gemma2"),
    "gemma3": Case("Gemma3TextConfig", {"tie_word_embeddings": True, "sliding_window": WINDOW,
                                        "query_pre_attn_scalar": 12, "num_hidden_layers": 6,
                                        "rope_parameters": {
                                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 100000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}},
                   "gemma3"),
    "phi3": Case("Phi3Config", {"partial_rotary_factor": 0.5, "sliding_window": None,
                                "rope_scaling": {"rope_type": "longrope", "short_factor": (1.0, 2.0),
                                                 "long_factor": (1.0, 5.0),
                                                 "original_max_position_embeddings": 16}}, "phi3"),
    "olmo2": Case("Olmo2Config", {}, "olmo2"),
    "granite": Case("GraniteConfig", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                      "attention_multiplier": 0.2, "logits_scaling": 4.0}, "granite"),
    "smollm3": Case("SmolLM3Config", {"no_rope_layer_interval": 4}, "smollm3"),
}


#: The spread of the random weights: wide enough that logits differ by whole units, so 1e-4
#: checks something; a bench may take a calmer model (`STD` is read at each call).
STD = 0.15


def reference_model(name: str, seed: int = 0):
    """transformers' model of case `name` with random weights (norm weights around 1, or around
    0 for Gemma's 1 + w), in fp32 with eager attention."""
    import transformers

    case = CASES[name]
    config = getattr(transformers, case.config_class)(**_sized({**SHAPE, **case.options}))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(param + torch.randn_like(param) * 0.2)
            else:
                param.normal_(0.0, STD)
    return model.eval()


def _sized(options: dict) -> dict:
    """`options` with longrope's factors, given as (first, last), spread over each rotary pair
    of the shape's heads."""
    scaling = options.get("rope_scaling")
    if not scaling or scaling.get("rope_type") != "longrope":
        return options
    pairs = int(options["head_dim"] * options.get("partial_rotary_factor", 1.0)) // 2
    spread = {key: torch.linspace(*scaling[key], pairs).tolist() for key in ("short_factor", "long_factor")}
    return {**options, "rope_scaling": {**scaling, **spread}}


def write_case(name: str, directory: Path, seed: int = 0):
    """Case `name` saved as a Hugging Face directory; returns transformers' model."""
    model = reference_model(name, seed)
    model.save_pretrained(str(directory))
    return model


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, up to (not with) its end token, as the node
    streams it."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=SHAPE["eos_token_id"], pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    return tokens[: tokens.index(SHAPE["eos_token_id"])] if SHAPE["eos_token_id"] in tokens else tokens
