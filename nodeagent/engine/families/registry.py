"""The registry of families: each found by Hugging Face `model_type` or GGUF
`general.architecture`, and the decoders known but not run, refused by name."""


from __future__ import annotations

from nodeagent.daemon import ModelLoadError
from nodeagent.engine.families.base import Family
from nodeagent.engine.families.gemma import Gemma2, Gemma3
from nodeagent.engine.families.granite import Granite
from nodeagent.engine.families.llama import Llama
from nodeagent.engine.families.olmo2 import Olmo2
from nodeagent.engine.families.phi3 import Phi3
from nodeagent.engine.families.qwen3 import Qwen3
from nodeagent.engine.families.smollm3 import SmolLM3

FAMILIES: tuple[Family, ...] = (Llama(), Qwen3(), Gemma2(), Gemma3(), Phi3(), Olmo2(), Granite(), SmolLM3())

#: Known decoders this engine does not run, and what they would need.
NOT_RUN = {
    "mixtral": "a mixture of experts",
    "qwen2_moe": "a mixture of experts",
    "qwen3_moe": "a mixture of experts",
    "olmoe": "a mixture of experts",
    "granitemoe": "a mixture of experts",
    "phimoe": "a mixture of experts",
    "deepseek_v2": "a mixture of experts with latent attention",
    "deepseek_v3": "a mixture of experts with latent attention",
    "gpt_oss": "a mixture of MXFP4 experts",
    "gemma3": "a vision-language checkpoint (its text model, model_type gemma3_text, runs)",
    "mamba": "a state-space model",
    "mamba2": "a state-space model",
    "jamba": "a hybrid state-space model",
    "falcon_h1": "a hybrid state-space model",
}


def supported() -> str:
    """The families the engine runs, for messages."""
    return ", ".join(t for family in FAMILIES for t in family.model_types)


def by_model_type(model_type: str) -> Family:
    """The family of a Hugging Face `model_type`; ModelLoadError naming what runs otherwise."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ModelLoadError(f"config.json: model_type {model_type!r} {_not_run(model_type)}")


def by_architecture(arch: str) -> Family:
    """The family of a GGUF `general.architecture`."""
    for family in FAMILIES:
        if arch in family.architectures:
            return family
    raise ModelLoadError(f"GGUF architecture {arch!r} {_not_run(arch)}")


def _not_run(name: str) -> str:
    what = NOT_RUN.get(name.replace("-", "_"))
    kind = f" ({what})" if what else ""
    return f"is not a decoder this engine runs{kind}; it runs: {supported()}"
