"""fleet's session payload codecs: GenParams in SESSION_ASSIGN, the context in APPEND_CONTENT."""

import math

import pytest

from proto.fleet import decode_params, decode_tokens, encode_params, encode_tokens
from proto.params import GenParams
from proto.postcard import PostcardError

SAMPLED = GenParams(temperature=0.7, top_p=0.95, min_p=0.0, top_k=40, seed=42)
SAMPLED_BYTES = bytes.fromhex("33 33 33 3f 33 33 73 3f 00 00 00 00 28 2a")


def test_params_vectors_of_the_spec():
    assert encode_params(GenParams()) == bytes(14)
    assert encode_params(SAMPLED) == SAMPLED_BYTES


def test_params_decode_to_their_f32_values():
    got = decode_params(SAMPLED_BYTES)
    assert got == GenParams(float.fromhex("0x1.666666p-1"), float.fromhex("0x1.e66666p-1"), 0.0, 40, 42)
    assert encode_params(got) == SAMPLED_BYTES


@pytest.mark.parametrize("data", [b"", b"\x00", SAMPLED_BYTES[:13], SAMPLED_BYTES[:12] + b"\xff" * 11])
def test_params_that_do_not_decode_are_greedy(data):
    assert decode_params(data) == GenParams()


def test_params_decode_like_rust_from_bytes_on_foreign_bytes():
    # postcard::from_bytes reads a whole GenParams and ignores what follows; any f32 bits pass.
    got = decode_params(b"\xff" * 12 + b"\x05\x06\x07")
    assert math.isnan(got.temperature) and (got.top_k, got.seed) == (5, 6)


def test_tokens_roundtrip():
    tokens = [0, 1, 127, 128, 151_935, 0xFFFFFFFF]
    assert decode_tokens(encode_tokens(tokens)) == tokens
    assert encode_tokens([1, 2, 300]) == bytes.fromhex("03 01 02 ac 02")
    assert encode_tokens([]) == b"\x00"


@pytest.mark.parametrize("data", [b"", b"\x02\x01", b"\x01\xff\xff\xff\xff\x10", b"\x01\x80\x80\x80\x80\x80\x00"])
def test_malformed_tokens_raise(data):
    with pytest.raises(PostcardError):
        decode_tokens(data)


def test_out_of_range_tokens_are_not_encoded():
    with pytest.raises(PostcardError):
        encode_tokens([1 << 32])
    with pytest.raises(PostcardError):
        encode_tokens([-1])
