"""The client's text codec: a GGUF's own vocabulary and chat template, or a directory's
tokenizer.json, give the ids transformers gives, without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gguf_fixtures import CHAT_TEMPLATE, CONFIG_FOR_VOCAB, train_vocab
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.text import StreamDecoder, TextCodecError, load_text_codec
from proto import models

VOCAB = train_vocab()
TEXTS = [
    "The capital of France is Paris.",
    "Numbers: 12345, 2026 and 7 8 9!",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "naïve café — 日本語 🎉",
    "<|im_start|>user\nhi<|im_end|>",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "How are you today?"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from nodeagent.engine.builtin import random_tensors
    from nodeagent.engine.checkpoint import write_gguf

    path = tmp_path_factory.mktemp("codec") / "tiny-chat.gguf"
    return write_gguf(path, CONFIG_FOR_VOCAB, random_tensors(CONFIG_FOR_VOCAB, seed=1), {}, VOCAB)


@pytest.fixture(scope="module")
def theirs(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def test_gguf_vocabulary_encodes_and_decodes_as_transformers(gguf_path, theirs):
    codec = load_text_codec(str(gguf_path))
    for text in TEXTS:
        ids = codec.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert codec.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_gguf_chat_template_renders_as_transformers(gguf_path, theirs):
    codec = load_text_codec(str(gguf_path))
    assert codec.chat_template == CHAT_TEMPLATE
    for messages in MESSAGES:
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert codec.chat(messages) == expected


def test_a_directory_with_tokenizer_json_and_its_config(tmp_path, gguf_path):
    """The directory form: tokenizer.json as `tokenizers` saves it, the template and the
    special tokens from tokenizer_config.json."""
    codec = load_text_codec(str(gguf_path))
    codec.tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": {"content": "<|im_end|>"}, "bos_token": "<|im_start|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    directory = load_text_codec(str(tmp_path))
    assert directory.eos_token == "<|im_end|>" and directory.bos_token == "<|im_start|>"
    for messages in MESSAGES:
        assert directory.chat(messages) == codec.chat(messages)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_stream_decoding_adds_up_to_the_whole_text(text):
    codec = load_text_codec(_tiny_gguf_once())
    ids = codec.encode(text)
    stream = StreamDecoder(codec)
    pieces = [stream.feed([i]) for i in ids]
    assert "".join(pieces) == codec.decode(ids)
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


_TINY: list[str] = []


def _tiny_gguf_once() -> str:
    """One GGUF for the hypothesis test, which cannot take function-scoped fixtures."""
    if not _TINY:
        import tempfile

        from nodeagent.engine.builtin import random_tensors
        from nodeagent.engine.checkpoint import write_gguf

        path = f"{tempfile.mkdtemp()}/stream.gguf"
        write_gguf(path, CONFIG_FOR_VOCAB, random_tensors(CONFIG_FOR_VOCAB, seed=1), {}, VOCAB)
        _TINY.append(path)
    return _TINY[0]


def test_nothing_usable_is_a_text_codec_error(tmp_path, monkeypatch):
    with pytest.raises(TextCodecError, match="no tokenizer found"):
        load_text_codec(str(tmp_path))
    monkeypatch.setitem(
        models.ALIASES, "absent-model", models.Alias("absent-model", "no-such-dist-xyz", "a/b.gguf", "pip install x")
    )
    with pytest.raises(TextCodecError, match="not installed; install it with: pip install x"):
        load_text_codec("absent-model")


def test_the_codec_never_imports_torch_or_the_node(gguf_path):
    """It reads the file's vocabulary with the `gguf` package, never through the node's code."""
    code = (
        "import sys; from conformance.text import load_text_codec; "
        f"c = load_text_codec({str(gguf_path)!r}); c.chat([{{'role': 'user', 'content': 'hi'}}]); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] == 'nodeagent'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
