"""Property tests: every struct round-trips, and no input makes `from_bytes` raise anything but
PostcardError."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.params import GenParams
from proto import linkf
from proto import postcard as pc
from proto.linkf import PAYLOAD_TYPES
from proto.postcard import PostcardError, from_bytes, to_bytes
from strategies import structs

STRUCTS = sorted(
    {*PAYLOAD_TYPES.values(), GenParams}
    | {v for v in vars(linkf).values() if isinstance(v, type) and dataclasses.is_dataclass(v)},
    key=lambda c: c.__name__,
)
@pytest.mark.parametrize("cls", STRUCTS, ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_struct_roundtrips(cls, data):
    value = data.draw(structs(cls))
    assert from_bytes(cls, to_bytes(value)) == value


def decodes_or_raises_postcard_error(wire, data):
    try:
        value = from_bytes(wire, data)
    except PostcardError as e:
        assert e.offset is None or 0 <= e.offset <= len(data)
        assert str(e).startswith(pc.wire_type(wire).name)
    else:
        assert not isinstance(wire, type) or type(value) in getattr(wire, "_variants", (wire,))


DECODED = sorted(set(PAYLOAD_TYPES.values()) | {GenParams}, key=lambda c: c.__name__) + [
    pc.Vec[pc.U32],
    pc.Vec[pc.U16],
    pc.Vec[pc.Str],
    pc.Option[pc.Bytes],
    pc.Tuple[pc.U16, pc.U64],
    linkf.TokenEventPayload,
]


@pytest.mark.parametrize("cls", DECODED, ids=lambda c: getattr(c, "__name__", None) or c.name)
@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=48))
def test_arbitrary_bytes_decode_or_raise_postcard_error(cls, data):
    decodes_or_raises_postcard_error(cls, data)


@pytest.mark.parametrize("cls", [linkf.TokenEventsMsg, linkf.ReconcileMsg, linkf.ReconcileAckMsg, linkf.HelloAckF,
                                 linkf.SessionAssignMsg, linkf.StageForwardReqMsg, linkf.AppendContentMsg],
                         ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_damaged_encodings_decode_or_raise_postcard_error(cls, data):
    """Valid bytes with some bytes overwritten and the end cut off reach the deep fields."""
    encoded = bytearray(to_bytes(data.draw(structs(cls))))
    for _ in range(data.draw(st.integers(0, 3))):
        if encoded:
            encoded[data.draw(st.integers(0, len(encoded) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(encoded)))
    decodes_or_raises_postcard_error(cls, bytes(encoded[:cut]))


@settings(max_examples=60, deadline=None)
@given(value=st.integers(0, (1 << 64) - 1), extra=st.binary(max_size=4))
def test_varints_roundtrip_with_trailing_bytes_ignored(value, extra):
    for wire, bits in [(pc.U16, 16), (pc.U32, 32), (pc.U64, 64)]:
        if value < 1 << bits:
            assert from_bytes(wire, to_bytes(value, wire) + extra) == value
        else:
            with pytest.raises(PostcardError):
                to_bytes(value, wire)


@pc.struct
class _Field16:
    v: pc.U16


@pc.struct
class _Field32:
    v: pc.U32


@pc.struct
class _Field64:
    v: pc.U64


def reference_varint(data, bits):
    """LEB128 as upstream postcard reads it, a byte at a time: the value, or (reason, offset)."""
    size = -(-bits // 7)
    value = 0
    for i in range(size):
        if i >= len(data):
            return ("unexpected end of input", len(data))
        b = data[i]
        value |= (b & 0x7F) << 7 * i
        if b < 0x80:
            if i == size - 1 and b >> (bits - 7 * i):
                return (f"varint above the u{bits} range", 0)
            return value
    return (f"varint longer than {size} bytes", 0)


def read(wire, data):
    try:
        return from_bytes(wire, data)
    except PostcardError as e:
        return (e.reason, e.offset)


def leb128(value):
    """A varint's bytes from its 7-bit groups, lowest first, each but the last flagged: an
    oracle apart from the codec's own writers."""
    groups = [value >> shift & 0x7F for shift in range(0, max(value.bit_length(), 1), 7)]
    return bytes([g | 0x80 for g in groups[:-1]] + groups[-1:])


class _Int(int):
    """An int that is not exactly `int`, as an IntEnum or a numpy integer is not."""


#: The first and last value of each varint length, where a writer's shortcut may go wrong.
VARINT_EDGES = st.sampled_from(sorted({(1 << 7 * n) + d for n in range(1, 10) for d in (-1, 0, 1)}))


@settings(max_examples=300, deadline=None)
@given(value=VARINT_EDGES | st.integers(0, (1 << 64) - 1))
def test_a_varint_writes_as_leb128_alone_and_in_a_struct(value):
    """The generated varint writer, which writes up to six bytes without a call, and the plain
    one, which an int subclass takes, against an independent LEB128."""
    for wire, field, bits in [(pc.U16, _Field16, 16), (pc.U32, _Field32, 32), (pc.U64, _Field64, 64)]:
        if value >= 1 << bits:
            with pytest.raises(PostcardError):
                to_bytes(field(v=value))
            continue
        expected = leb128(value)
        assert to_bytes(value, wire) == expected
        assert to_bytes(field(v=value)) == expected
        assert to_bytes(field(v=_Int(value))) == expected


# Continuation bytes, and the bytes about each width's largest last byte (u64 1, u16 3, u32 15).
VARINT_BYTES = st.sampled_from([0x80, 0x81, 0xFF, 0, 1, 2, 3, 4, 15, 16, 0x7F]) | st.integers(0, 255)


@settings(max_examples=300, deadline=None)
@given(data=st.lists(VARINT_BYTES, min_size=1, max_size=12).map(bytes))
def test_a_varint_reads_alike_alone_in_a_struct_and_in_a_list(data):
    """The one generated varint reader, inlined three ways, against a plain byte loop."""
    for wire, field, bits in [(pc.U16, _Field16, 16), (pc.U32, _Field32, 32), (pc.U64, _Field64, 64)]:
        expected = reference_varint(data, bits)
        assert read(wire, data) == expected
        in_struct = read(field, data)
        assert in_struct == (expected if isinstance(expected, tuple) else field(v=expected))
        in_list = read(pc.Vec[wire], b"\x01" + data)
        assert in_list == ((expected[0], expected[1] + 1) if isinstance(expected, tuple) else [expected])
