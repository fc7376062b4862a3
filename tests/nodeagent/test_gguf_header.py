"""Our one-pass GGUF header reader against the gguf package's reader, on a file with every
metadata kind a model file carries, and on damaged files."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter

from nodeagent.gguf_header import GGUFHeaderError, read_header


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("header") / "kinds.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 3)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_float64("test.f64", 0.1)
    writer.add_int64("test.i64", -(2**40))
    writer.add_bool("test.flag", True)
    writer.add_string("tokenizer.chat_template", "{{ messages }} é 🎉")
    writer.add_array("tokenizer.ggml.tokens", ["a", "Ġb", "<|im_end|>", ""])
    writer.add_array("tokenizer.ggml.token_type", [1, 1, 3, 1])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_tensor("one", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("two", np.ones((2, 64), dtype=np.float16))
    writer.add_tensor("three", np.zeros((2, 34), dtype=np.uint8), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_and_tensors_agree_with_the_gguf_package(gguf_path):
    theirs = GGUFReader(str(gguf_path))
    ours = read_header(gguf_path)
    assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert [(t.name, t.shape, t.type) for t in ours.tensors] == [
        (t.name, tuple(int(n) for n in t.shape), int(t.tensor_type)) for t in theirs.tensors
    ]
    assert [ours.data_offset + t.offset for t in ours.tensors] == [int(t.data_offset) for t in theirs.tensors]


def test_metadata_alone_skips_the_tensors(gguf_path):
    header = read_header(gguf_path, with_tensors=False)
    assert header.tensors == [] and header.metadata["llama.block_count"] == 3


@pytest.mark.parametrize("cut", [3, 24, 100, 200])
def test_a_cut_or_foreign_file_is_a_header_error(gguf_path, tmp_path, cut):
    damaged = tmp_path / "cut.gguf"
    damaged.write_bytes(gguf_path.read_bytes()[:cut])
    with pytest.raises(GGUFHeaderError):
        read_header(damaged)
