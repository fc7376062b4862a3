"""Property tests of the frame decoder: any cutting of a valid stream gives the same frames, and
garbage only ever raises EnvelopeError."""

from hypothesis import given, settings
from hypothesis import strategies as st

from proto import EnvelopeError, Frame, FrameClass, FrameDecoder, encode_frame
from proto.linkf import ALL, is_known_type

frames = st.builds(
    lambda t, seq, version, payload: Frame(version, t, seq, 0, FrameClass.for_type(t), payload),
    st.sampled_from(ALL),
    st.integers(0, (1 << 64) - 1),
    st.integers(0, 0xFFFF),
    st.binary(max_size=40),
)


def decode_all(dec):
    out = []
    while (f := dec.decode_next()) is not None:
        out.append(f)
    return out


@settings(max_examples=150, deadline=None)
@given(sent=st.lists(frames, max_size=6), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_chunking_yields_the_same_frames(sent, cuts):
    stream = b"".join(map(encode_frame, sent))
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    dec = FrameDecoder(is_known_type)
    got = []
    for a, b in zip(bounds, bounds[1:]):
        dec.feed(stream[a:b])
        got += decode_all(dec)
    assert got == sent
    dec.finish()


@settings(max_examples=150, deadline=None)
@given(chunks=st.lists(st.binary(max_size=64), max_size=6), valid_prefix=st.lists(frames, max_size=2))
def test_garbage_raises_only_envelope_errors(chunks, valid_prefix):
    dec = FrameDecoder(is_known_type)
    dec.feed(b"".join(map(encode_frame, valid_prefix)))
    try:
        for chunk in chunks:
            dec.feed(chunk)
            decode_all(dec)
        dec.finish()
    except EnvelopeError:
        pass


@settings(max_examples=100, deadline=None)
@given(
    t=st.integers(0, 0xFFFF),
    class_byte=st.integers(0, 255),
    length=st.integers(0, 64),
    payload=st.binary(max_size=64),
)
def test_crafted_headers_decode_or_raise_envelope_errors(t, class_byte, length, payload):
    data = length.to_bytes(4, "little") + (2).to_bytes(2, "little") + t.to_bytes(2, "little") + bytes(16)
    data += bytes([class_byte]) + payload
    dec = FrameDecoder(lambda _: True)
    dec.feed(data)
    try:
        f = dec.decode_next()
    except EnvelopeError:
        return
    assert f is None or (f.msg_type == t and f.class_ == class_byte == FrameClass.for_type(t))
