"""Every decoder family against transformers on the same random weights (`families.CASES`):
logits within 1e-4 in process, in fp32, from the Hugging Face directory and from the F32 GGUF
that llama.cpp's own converter writes of it; greedy tokens equal over Link F from both; and each
family's own option shown to matter, so the checks can fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from families import CASES, PROMPT, VOCAB, reference_greedy, reference_logits, write_case
from helpers import placed
from llamacpp_tree import convert, write_byte_level_bpe, write_sentencepiece

from conformance.head import FleetHead
from nodeagent.daemon import ModelLoadError
from nodeagent.engine.families import registry
from nodeagent.engine.families.spec import Activation, Norms, QKNorm, Rope
from nodeagent.engine.gguf_file import load_gguf
from nodeagent.engine.loader import config_from_hf, load_model
from nodeagent.engine.model import LlamaModel
from nodeagent.engine.torch_engine import TorchDaemon

pytest.importorskip("transformers")

CPU = torch.device("cpu")
NEW_TOKENS = 12
#: The families whose converter reads a byte-level BPE tokenizer rather than sentencepiece.
BYTE_LEVEL = ("olmo2",)
GGUF_CASES = [name for name, case in CASES.items() if case.arch]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each case's Hugging Face directory, transformers' model of it, and (where llama.cpp has
    the architecture) the F32 GGUF its converter writes; made once for the module."""
    made = {}
    for name in CASES:
        directory = tmp_path_factory.mktemp(name)
        model = write_case(name, directory)
        gguf = None
        if CASES[name].arch:
            (write_byte_level_bpe if name in BYTE_LEVEL else write_sentencepiece)(directory, 60)
            gguf = convert(directory, directory / f"{name}-f32.gguf", byte_level=name in BYTE_LEVEL)
        made[name] = (directory, model, gguf)
    return made


def our_logits(model: LlamaModel) -> torch.Tensor:
    with torch.inference_mode():
        x = model.run_causal(model.embed(torch.tensor([PROMPT])), 0, model.config.n_layers)
        return model.logits(x[0])


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_from_the_hf_directory(checkpoints, name):
    directory, reference, _ = checkpoints[name]
    ours = load_model(directory, torch.float32, CPU)
    assert ours.config.spec.family == registry.by_model_type(reference.config.model_type).name
    diff = (our_logits(ours) - reference_logits(reference, PROMPT)).abs().max()
    assert float(diff) <= 1e-4, f"{name}: largest logit difference {float(diff):.2e}"


@pytest.mark.parametrize("name", GGUF_CASES)
def test_logits_match_transformers_from_llama_cpp_s_converted_gguf(checkpoints, name):
    _, reference, gguf = checkpoints[name]
    ours = load_gguf(gguf, torch.float32, CPU)
    assert ours.config.spec.family == registry.by_architecture(CASES[name].arch).name
    diff = (our_logits(ours) - reference_logits(reference, PROMPT)).abs().max()
    assert float(diff) <= 1e-4, f"{name}: largest logit difference {float(diff):.2e}"


def _served_greedy(start_node, path) -> list[int]:
    daemon = TorchDaemon.load(str(path), device="cpu", max_batch=2, kv_budget_mb=4, weights="float",
                              kv_dtype="float32")
    node = start_node(daemon, model="family")
    with FleetHead.connect(node.addr) as head:
        placed(head, 1, PROMPT)
        return head.generate(1, NEW_TOKENS).tokens


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_over_link_f_equal_transformers(checkpoints, start_node, name):
    directory, reference, gguf = checkpoints[name]
    expected = reference_greedy(reference, PROMPT, NEW_TOKENS)
    assert _served_greedy(start_node, directory) == expected, f"{name} from its Hugging Face directory"
    if gguf is not None:
        assert _served_greedy(start_node, gguf) == expected, f"{name} from llama.cpp's F32 GGUF"


#: One of each family's options switched off in our spec: the logits must then leave 1e-4, so
#: the checks above are shown to see it.
MUTATIONS = {
    "qwen3": {"qk_norm": QKNorm.NONE},
    "gemma2": {"attn_softcap": None},
    "gemma3": {"layer_ropes": ()},
    "granite": {"logit_scale": 1.0},
    "smollm3": {"layer_ropes": ()},
    "phi3": {"layer_ropes": (Rope(10000.0),) * 4},
    "qwen2-window-layers": {"layer_windows": ()},
}


@pytest.mark.parametrize("name", [*MUTATIONS, "olmo2"])
def test_each_family_s_own_option_changes_the_logits(checkpoints, name):
    directory, reference, _ = checkpoints[name]
    model = load_model(directory, torch.float32, CPU)
    spec = dataclasses.replace(model.config.spec, **MUTATIONS.get(name, {}))
    layers = model.layers
    if name == "olmo2":  # its q/k norms over the whole projections, held as weights
        layers = [dataclasses.replace(w, q_norm=None, k_norm=None) for w in layers]
    config = dataclasses.replace(model.config, spec=spec)
    mutated = LlamaModel(config, model.embedding, layers, model.norm, model.lm_head)
    diff = (our_logits(mutated) - reference_logits(reference, PROMPT)).abs().max()
    assert float(diff) > 1e-2, f"{name}: {MUTATIONS.get(name)} left the logits within {float(diff):.2e}"


def test_each_family_reads_its_maths_from_config_json():
    base = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 2, "head_dim": 8}
    gemma = config_from_hf({**base, "model_type": "gemma2", "query_pre_attn_scalar": 32,
                            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}).spec
    assert (gemma.norms, gemma.activation, gemma.attn_softcap, gemma.final_softcap) == \
        (Norms.SANDWICH, Activation.GELU_TANH, 50.0, 30.0)
    assert gemma.embed_scale == pytest.approx(4.0) and gemma.query_scale == pytest.approx(0.5)
    olmo = config_from_hf({**base, "model_type": "olmo2"}).spec
    assert (olmo.norms, olmo.qk_norm) == (Norms.POST, QKNorm.PROJECTION)
    smol = config_from_hf({**base, "model_type": "smollm3"}).spec
    assert [rope is None for rope in smol.layer_ropes] == [False, False, False, True]
    assert "per-layer rope" in smol.why_not_plain()


@pytest.mark.parametrize(
    "model_type,named",
    [("mixtral", "a mixture of experts"), ("qwen3_moe", "a mixture of experts"), ("mamba", "a state-space model"),
     ("bert", "is not a decoder this engine runs")],
)
def test_a_family_not_run_is_refused_by_name_listing_those_that_run(model_type, named):
    with pytest.raises(ModelLoadError) as caught:
        config_from_hf({"model_type": model_type, "vocab_size": VOCAB})
    message = str(caught.value)
    assert named in message and f"model_type {model_type!r}" in message
    assert all(family in message for family in ("llama", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2",
                                                "granite", "smollm3"))
