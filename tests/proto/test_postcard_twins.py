"""The fast twins against the plain ones, which define the format (`proto/postcard.py`): on
every wire type of the catalog, the same bytes for a value and the same value for bytes; for
damaged bytes or a bad value, the same failure, which `from_bytes` and `to_bytes` report as the
plain twin words it."""

import dataclasses
import enum
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import handshake, linkf, linkw
from proto import postcard as pc
from proto.params import GenParams
from proto.postcard import PostcardError, from_bytes, to_bytes
from strategies import values


def inner_types(t):
    """The wire types `t` is made of, one level down."""
    if isinstance(t, pc._StructType):
        return [field for _, field in t.fields]
    if isinstance(t, pc._DataEnum):
        return t.structs
    if isinstance(t, pc._VecType):
        return [t.elem]
    if isinstance(t, pc._OptionType):
        return [t.inner]
    if isinstance(t, pc._TupleType):
        return list(t.elems)
    return []


def catalog():
    """Every wire type of the Link F, handshake and Link W messages and of `GenParams`, and every
    type inside them."""
    roots = [GenParams] + [
        v
        for module in (linkf, handshake, linkw)
        for v in vars(module).values()
        if isinstance(v, type)
        and (dataclasses.is_dataclass(v) or issubclass(v, enum.IntEnum))
        and v is not linkf.MsgType
    ]
    found: dict[pc.WireType, None] = {}
    todo = [pc.wire_type(r) for r in roots]
    while todo:
        t = todo.pop()
        if t not in found:
            found[t] = None
            todo += inner_types(t)
    return sorted(found, key=repr)


CATALOG = catalog()


def test_the_catalog_reaches_every_kind_of_wire_type():
    kinds = {type(t) for t in CATALOG}
    assert {pc._StructType, pc._DataEnum, pc._VarintVec, pc._VecType, pc._OptionType, pc._TupleType} <= kinds
    assert {pc._Varint, pc._U8, pc._Bool, pc._F32Type, pc._Str, pc._Bytes, pc._Array32, pc._UnitEnum} <= kinds
    assert len(CATALOG) >= 40


def plain_bytes(wire, value):
    out = bytearray()
    wire.encode(value, out)
    return bytes(out)


@pytest.mark.parametrize("wire", CATALOG, ids=repr)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_fast_twins_write_and_read_what_the_plain_ones_do(wire, data):
    value = data.draw(values(wire))
    encoded = plain_bytes(wire, value)
    fast = bytearray()
    wire.fast().encode(value, fast)
    assert fast == encoded
    assert wire.fast().decode(encoded, 0) == wire.decode(encoded, 0) == (value, len(encoded))
    assert wire.fast().read(encoded) == value


FAILED = "failed"


def plain_outcome(read, data):
    """What `read(data, 0)` gives, or (FAILED, its `PostcardError`)."""
    try:
        return read(data, 0)
    except PostcardError as e:
        return FAILED, e


def fast_outcome(read, data):
    try:
        return read(data, 0)
    except pc._DECODE_ERRORS:
        return FAILED, None


def top_level_words(call):
    """The words of the `PostcardError` that `call` raises."""
    with pytest.raises(PostcardError) as e:
        call()
    return str(e.value)


#: Continuation bytes, the bytes about each varint width's largest last byte (u16 3, u32 15,
#: u64 1) and about the bool and Option tags, or any.
DAMAGE_BYTES = st.sampled_from([0x80, 0x81, 0xFF, 0, 1, 2, 3, 4, 15, 16, 0x7F]) | st.integers(0, 255)


def damage(data, encoded):
    """`encoded` with up to three bytes overwritten and the end cut off."""
    damaged = bytearray(encoded)
    for _ in range(data.draw(st.integers(0, 3))):
        if damaged:
            damaged[data.draw(st.integers(0, len(damaged) - 1))] = data.draw(DAMAGE_BYTES)
    return bytes(damaged[: data.draw(st.integers(0, len(damaged)))])


@pytest.mark.parametrize("wire", CATALOG, ids=repr)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_damaged_bytes_fail_alike(wire, data):
    """The fast twin fails where the plain one does, and `from_bytes` then says what the plain
    one says; where neither fails they read the same."""
    assert_read_alike(wire, damage(data, plain_bytes(wire, data.draw(values(wire)))))


def test_a_nan_read_from_the_wire_reads_alike():
    """Damage can make an f32 a NaN, which equals nothing, itself included."""
    wire = pc.wire_type(GenParams)
    encoded = bytearray(plain_bytes(wire, GenParams(temperature=float("inf"))))
    encoded[0] = 1
    damaged = bytes(encoded)
    assert math.isnan(wire.decode(damaged, 0)[0].temperature)
    assert_read_alike(wire, damaged)


def assert_read_alike(wire, damaged):
    plain = plain_outcome(wire.decode, damaged)
    assert (fast_outcome(wire.fast().decode, damaged)[0] is FAILED) == (plain[0] is FAILED)
    if plain[0] is FAILED:
        assert top_level_words(lambda: from_bytes(wire, damaged)) == str(plain[1].within(wire.name))
    else:  # compared by repr, where a NaN equals itself
        assert repr(wire.fast().decode(damaged, 0)) == repr(plain)
        assert repr(from_bytes(wire, damaged)) == repr(plain[0])


#: Values of the wrong type or range for some field, or for all.
BAD_VALUES = st.sampled_from(
    [-1, 256, 1 << 16, 1 << 32, 1 << 64, 2.5, "x", b"xy", None, True, [1, -1], [1 << 32], object()]
)


@pytest.mark.parametrize("wire", [t for t in CATALOG if isinstance(t, pc._StructType) and t.fields], ids=repr)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_bad_field_fails_alike(wire, data):
    """A struct with one field bad: what the fast twin writes, if it writes at all, the plain one
    writes too; `to_bytes` writes what the plain one does or says what the plain one says."""
    name, _ = data.draw(st.sampled_from(wire.fields))
    value = dataclasses.replace(data.draw(values(wire)), **{name: data.draw(BAD_VALUES)})
    plain = bytearray()
    try:
        wire.encode(value, plain)
    except PostcardError as e:
        assert top_level_words(lambda: to_bytes(value, wire)) == str(e.within(wire.name))
        plain = None
    else:
        assert to_bytes(value, wire) == plain
    fast = bytearray()
    try:
        wire.fast().encode(value, fast)
    except pc._ENCODE_ERRORS:
        return
    assert fast == plain
