"""The hand-derived golden vectors of tests/vectors/linkf.cbor (see gen_linkf.py there)."""

from pathlib import Path

import cbor2
import pytest

from proto.params import GenParams
from proto.linkf import ALL, PAYLOAD_TYPES
from proto.postcard import U16, U32, Vec, from_bytes, to_bytes, to_plain

RECORDS = cbor2.loads((Path(__file__).resolve().parents[1] / "vectors" / "linkf.cbor").read_bytes())
BARE_TYPES = {"u16": U16, "Vec<u32>": Vec[U32], "GenParams": GenParams}


def ordered(value):
    """`value` with each dict as its list of items, so that comparing also compares field order."""
    if isinstance(value, dict):
        return [(k, ordered(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [ordered(x) for x in value]
    return value


def wire_of(rec):
    return BARE_TYPES[rec["type"]] if rec["msg_type"] is None else PAYLOAD_TYPES[rec["msg_type"]]


@pytest.mark.parametrize("rec", RECORDS, ids=[r["name"] for r in RECORDS])
def test_vector_decodes_to_its_fields_and_reencodes_to_its_bytes(rec):
    wire = wire_of(rec)
    value = from_bytes(wire, rec["postcard"])
    assert ordered(to_plain(value)) == ordered(rec["fields"])
    assert to_bytes(value, wire) == rec["postcard"]


def test_every_msg_type_has_a_vector():
    covered = {r["msg_type"] for r in RECORDS}
    assert set(ALL) <= covered


def test_worked_vectors_of_the_spec_are_all_there():
    names = {r["name"] for r in RECORDS}
    for name in ["u16 0", "u16 127", "u16 128", "u16 16384", "u16 65535", "Vec<u32> []",
                 "Vec<u32> [1, 2, 300]", "Vec<u32> [0xFFFFFFFF]", "GenParams::default()",
                 "GenParams{0.7, 0.95, 0, 40, 42}"]:
        assert name in names
