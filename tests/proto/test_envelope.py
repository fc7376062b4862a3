"""The envelope: the Rust crate's tests/envelope.rs, ported, plus the layout of §1.

The Rust tests use Link W types; Link W's catalog is not ported, so these use Link F ones of the
same class (LEASE_RENEW / LEASE_GRANT for PING / PONG, TELEMETRY for TELEMETRY, KEEPALIVE with an
empty payload for DRAINED's empty one). 0x0FFF and 0x8FFF are unknown to both catalogs.
"""

import struct
import time

import pytest

from proto import HEADER_LEN, MAX_FRAME, EnvelopeError, Frame, FrameClass, FrameDecoder, encode_frame
from proto.envelope import FRAME_HEAD, BadLength, ClassRangeMismatch, FrameTooLarge, Truncated, UnknownRequiredType
from proto.linkf import is_known_type, msg_type

PING = msg_type.LEASE_RENEW
PONG = msg_type.LEASE_GRANT


def always_known(_):
    return True


def frame(t, payload=b"", seq=1, version=2, correlation_id=0, class_=None):
    class_ = FrameClass.for_type(t) if class_ is None else class_
    return Frame(version, t, seq, correlation_id, class_, payload)


def raw_header(length, t, class_byte, version=1):
    return FRAME_HEAD.pack(length, version, t, 0, 0, class_byte)


def test_round_trip_single_frame():
    payload = b"hello superfluid"
    data = encode_frame(Frame(7, PING, 123, 456, FrameClass.REQUIRED, payload))
    dec = FrameDecoder(is_known_type)
    dec.feed(data)
    got = dec.decode_next()
    assert got == Frame(7, PING, 123, 456, FrameClass.REQUIRED, payload)
    assert dec.decode_next() is None
    dec.finish()


def test_round_trip_empty_payload():
    dec = FrameDecoder(is_known_type)
    dec.feed(encode_frame(frame(msg_type.KEEPALIVE)))
    assert dec.decode_next().payload == b""


def test_multiple_frames_in_one_feed():
    dec = FrameDecoder(is_known_type)
    dec.feed(encode_frame(frame(PING, b"a", seq=1)) + encode_frame(frame(PONG, b"bb", seq=2, correlation_id=1)))
    assert dec.decode_next().msg_type == PING
    assert dec.decode_next().msg_type == PONG
    assert dec.decode_next() is None


def test_decoder_handles_byte_at_a_time_feed():
    payload = bytes(range(200))
    data = encode_frame(Frame(3, msg_type.TELEMETRY, 9, 9, FrameClass.DROPPABLE, payload))
    dec = FrameDecoder(is_known_type)
    for b in data[:-1]:
        dec.feed(bytes([b]))
        assert dec.decode_next() is None, "must not decode early"
    dec.feed(data[-1:])
    got = dec.decode_next()
    assert got.payload == payload
    assert got.class_ == FrameClass.DROPPABLE


def test_cap_enforced_on_encode():
    with pytest.raises(FrameTooLarge) as e:
        encode_frame(frame(PING, bytes(MAX_FRAME - 20)))
    assert e.value.len == MAX_FRAME + 1
    assert str(MAX_FRAME + 1) in str(e.value)


def test_largest_frame_encodes():
    data = encode_frame(frame(PING, bytes(MAX_FRAME - HEADER_LEN)))
    assert struct.unpack_from("<I", data)[0] == MAX_FRAME


def test_cap_enforced_on_decode_without_buffering_full_payload():
    dec = FrameDecoder(always_known)
    dec.feed(raw_header(MAX_FRAME + 1, PING, 0))
    with pytest.raises(FrameTooLarge) as e:
        dec.decode_next()
    assert (e.value.len, e.value.max) == (MAX_FRAME + 1, MAX_FRAME)


def test_cap_enforced_from_the_length_field_alone():
    dec = FrameDecoder(always_known)
    dec.feed(struct.pack("<I", 0xFFFFFFFF))
    with pytest.raises(FrameTooLarge):
        dec.decode_next()


def test_bad_length_below_header_size_rejected():
    dec = FrameDecoder(always_known)
    dec.feed(struct.pack("<I", 20) + bytes(20))
    with pytest.raises(BadLength) as e:
        dec.decode_next()
    assert (e.value.len, e.value.min) == (20, 21)
    assert "20" in str(e.value)


def test_class_range_mismatch_rejected():
    dec = FrameDecoder(always_known)
    dec.feed(raw_header(22, PING, 1) + b"x")
    with pytest.raises(ClassRangeMismatch) as e:
        dec.decode_next()
    assert (e.value.msg_type, e.value.class_byte, e.value.expected) == (PING, 1, FrameClass.REQUIRED)
    assert "0x0008" in str(e.value)


def test_class_byte_other_than_0_or_1_rejected():
    dec = FrameDecoder(always_known)
    dec.feed(raw_header(21, msg_type.KEEPALIVE, 2))
    with pytest.raises(ClassRangeMismatch) as e:
        dec.decode_next()
    assert e.value.class_byte == 2


def test_encode_rejects_class_range_mismatch_too():
    with pytest.raises(ClassRangeMismatch):
        encode_frame(frame(PING, b"x", class_=FrameClass.DROPPABLE))


def test_encode_rejects_header_fields_out_of_range():
    with pytest.raises(EnvelopeError):
        encode_frame(frame(PING, seq=1 << 64))


def test_unknown_required_type_is_a_protocol_error():
    assert not is_known_type(0x0FFF)
    dec = FrameDecoder(is_known_type)
    dec.feed(encode_frame(frame(0x0FFF, b"x")))
    with pytest.raises(UnknownRequiredType) as e:
        dec.decode_next()
    assert e.value.msg_type == 0x0FFF
    assert "0x0fff" in str(e.value)


def test_unknown_droppable_type_is_skipped_safely():
    assert not is_known_type(0x8FFF)
    dec = FrameDecoder(is_known_type)
    dec.feed(encode_frame(frame(0x8FFF, b"ignored", seq=1)) + encode_frame(frame(PONG, b"kept", seq=2)))
    got = dec.decode_next()
    assert (got.msg_type, got.payload) == (PONG, b"kept")
    assert dec.decode_next() is None


def test_truncated_frame_reported_on_finish():
    data = encode_frame(frame(PING, b"hello"))
    dec = FrameDecoder(always_known)
    dec.feed(data[:-3])
    assert dec.decode_next() is None
    with pytest.raises(Truncated) as e:
        dec.finish()
    assert e.value.buffered == len(data) - 3


def test_truncated_within_header_itself_reported_on_finish():
    dec = FrameDecoder(always_known)
    dec.feed(bytes([1, 2, 3]))
    assert dec.decode_next() is None
    with pytest.raises(Truncated) as e:
        dec.finish()
    assert e.value.buffered == 3


def test_clean_finish_after_all_frames_consumed():
    dec = FrameDecoder(always_known)
    dec.feed(encode_frame(frame(PING, b"ok")))
    assert dec.decode_next() is not None
    dec.finish()


def test_layout_matches_the_spec_table():
    data = encode_frame(Frame(2, msg_type.WATERMARK_ACK, 0x0102030405060708, 0, FrameClass.REQUIRED, b"\xaa"))
    assert data == bytes.fromhex(
        "16000000"  # len 22 = 21 + 1
        "0200"  # proto_version 2
        "0f00"  # msg_type 0x000F
        "0807060504030201"  # seq
        "0000000000000000"  # correlation_id
        "00"  # class Required
        "aa"
    )


def test_frame_class_follows_bit_15():
    assert FrameClass.for_type(msg_type.TELEMETRY) == FrameClass.DROPPABLE
    assert FrameClass.for_type(msg_type.KEEPALIVE) == FrameClass.DROPPABLE
    assert FrameClass.for_type(msg_type.STAGE_FORWARD_RESP) == FrameClass.REQUIRED


def test_large_frames_fed_in_small_chunks_decode_in_linear_time():
    payload = bytes(range(256)) * (4 * 1024 * 4)
    data = encode_frame(frame(msg_type.XFER_CHUNK, payload)) * 2
    dec = FrameDecoder(is_known_type)
    start = time.perf_counter()
    got = []
    for i in range(0, len(data), 1024):
        dec.feed(data[i : i + 1024])
        f = dec.decode_next()
        if f is not None:
            got.append(f)
    assert [f.payload == payload for f in got] == [True, True]
    dec.finish()
    assert time.perf_counter() - start < 5.0


def test_many_small_frames_byte_at_a_time():
    frames = [frame(PING, bytes([i % 256]) * (i % 7), seq=i) for i in range(1, 3000)]
    data = b"".join(map(encode_frame, frames))
    dec = FrameDecoder(is_known_type)
    got = []
    for i in range(len(data)):
        dec.feed(data[i : i + 1])
        f = dec.decode_next()
        if f is not None:
            got.append(f)
    assert got == frames
    dec.finish()
