"""The Link F catalog: linkf.rs's unit tests, ported, and the catalog's shape (§3)."""

import pytest

from proto import FrameClass
from proto.handshake import Hello, HelloAckF
from proto.linkf import (
    ALL,
    PAYLOAD_TYPES,
    KeepAlive,
    LeaseGrantMsg,
    TelemetryMsg,
    decode_payload,
    is_known_type,
    msg_type,
)
from proto.postcard import PostcardError


def test_all_msg_types_are_known():
    for t in ALL:
        assert is_known_type(t)
    assert not is_known_type(0x00FF)


def test_catalog_has_28_distinct_types_each_with_a_payload():
    assert len(ALL) == len(set(ALL)) == 28
    assert set(PAYLOAD_TYPES) == set(ALL)
    names = [n for n in vars(msg_type) if n.isupper()]
    assert sorted(getattr(msg_type, n) for n in names) == sorted(ALL)


def test_only_telemetry_and_keepalive_are_droppable():
    droppable = [t for t in ALL if FrameClass.for_type(t) == FrameClass.DROPPABLE]
    assert droppable == [msg_type.TELEMETRY, msg_type.KEEPALIVE]


def test_numbers_follow_the_spec_table():
    assert (msg_type.HELLO, msg_type.HELLO_ACK_F, msg_type.WATERMARK_ACK) == (0x0001, 0x0002, 0x000F)
    assert (msg_type.NODE_STATUS, msg_type.GENERATE_CANCEL, msg_type.STAGE_FORWARD_RESP) == (0x0017, 0x0018, 0x001A)
    assert (msg_type.TELEMETRY, msg_type.KEEPALIVE) == (0x8001, 0x8002)


def test_handshake_payloads_come_from_the_handshake_module():
    assert PAYLOAD_TYPES[msg_type.HELLO] is Hello
    assert PAYLOAD_TYPES[msg_type.HELLO_ACK_F] is HelloAckF


def test_keepalive_is_an_empty_payload():
    assert PAYLOAD_TYPES[msg_type.KEEPALIVE] is KeepAlive
    assert decode_payload(msg_type.KEEPALIVE, b"") == KeepAlive()
    assert decode_payload(msg_type.KEEPALIVE, b"ignored") == KeepAlive()


def test_decode_payload_picks_the_catalog_type():
    assert decode_payload(msg_type.LEASE_GRANT, bytes([1, 2, 3, 4])) == LeaseGrantMsg(1, 2, 3, 4)
    assert decode_payload(msg_type.TELEMETRY, b"\x01x") == TelemetryMsg(spans=b"x")


def test_decode_payload_errors_are_postcard_errors():
    with pytest.raises(PostcardError) as e:
        decode_payload(0x0FFF, b"")
    assert "0x0fff" in str(e.value)
    with pytest.raises(PostcardError) as e:
        decode_payload(msg_type.LEASE_GRANT, b"\x01")
    assert str(e.value) == "LeaseGrantMsg.epoch: unexpected end of input at offset 1"
