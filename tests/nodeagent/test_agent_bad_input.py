"""A peer that breaks the protocol loses its own connection, with one error that says why; the
node keeps serving every other connection and the sessions they hold."""

import pytest

from conformance.head import FleetHead
from conformance.raw import RawLink, hung_up, raw_connect, raw_frame
from conformance.reference import mock_tokens
from linkf.errors import Envelope, Payload, Protocol
from nodeagent.daemon import DaemonError
from proto.fleet import encode_params
from proto.params import GenParams
from proto import postcard
from proto.envelope import MAX_FRAME
from proto.handshake import Hello, LinkRole
from proto.linkf import AppendContentMsg, Lease, PolicyUpdateMsg, SessionAssignMsg, TelemetryMsg, msg_type

PROMPT = [9, 8, 7, 6]
HELLO = raw_frame(msg_type.HELLO, postcard.to_bytes(Hello(proto_versions=(2, 3), link_role=LinkRole.HeadDaemon, auth=b"")))
ASSIGN = SessionAssignMsg(
    command_id=1 << 50, session_id=99, epoch=1 << 40, lease=Lease(duration_ms=60_000, renew_by_ms=50_000),
    codec="mock", params=encode_params(GenParams()),
)
BAD_BLOCKS = AppendContentMsg(command_id=(1 << 50) + 1, session_id=99, epoch=1 << 40, blocks=b"\x02\x01\xff")

# (what the peer sends after connecting, whether it said HELLO first, the error, a phrase of it)
CASES = {
    "malformed payload": (raw_frame(msg_type.SESSION_ASSIGN, b"\x01\x02", seq=2), True, Payload, "0x0005"),
    "unknown required type": (raw_frame(0x0100, b"", seq=2), True, Envelope, "0x0100"),
    "class byte against the type": (raw_frame(msg_type.KEEPALIVE, class_byte=0, seq=2), True, Envelope, "class byte"),
    "class byte out of range": (raw_frame(msg_type.LEASE_RENEW, b"\x00\x00", class_byte=7, seq=2), True, Envelope, "class byte"),
    "frame over 16 MiB": (raw_frame(msg_type.APPEND_CONTENT, length=MAX_FRAME + 1, seq=2), True, Envelope, "16777216"),
    "length under the header": (raw_frame(msg_type.KEEPALIVE, length=3, seq=2), True, Envelope, "length"),
    "garbage before HELLO": (b"\xff\xff\xff\x7f and then some", False, Envelope, "exceeds"),
    "HTTP before HELLO": (b"GET / HTTP/1.1\r\nHost: node\r\n\r\n", False, Protocol, "the peer speaks HTTP"),
    "TLS before HELLO": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", False, Protocol, "the peer speaks TLS"),
    "another frame before HELLO": (raw_frame(msg_type.GENERATE_CANCEL, b"\x01\x01"), False, Protocol, "expected Hello"),
    "malformed blocks": (
        raw_frame(msg_type.SESSION_ASSIGN, postcard.to_bytes(ASSIGN), seq=2)
        + raw_frame(msg_type.APPEND_CONTENT, postcard.to_bytes(BAD_BLOCKS), seq=3),
        True,
        DaemonError,
        "malformed APPEND_CONTENT blocks",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_ends_that_connection_only(node, case):
    data, after_hello, error, phrase = CASES[case]
    with FleetHead.connect(node.addr) as good:
        good.assign(1, GenParams())
        good.append(1, PROMPT)
        if after_hello:
            link = RawLink.connect(node.addr)
            link.hello(b"")
            sock = link.sock
        else:
            sock = raw_connect(node.addr)
        sock.sendall(data)
        assert hung_up(sock, 3.0), "the node kept a connection that broke the protocol"
        sock.close()
        outcome = node.outcome()
        assert isinstance(outcome, error), repr(outcome)
        assert phrase in str(outcome), str(outcome)
        assert good.generate(1, 6).tokens == mock_tokens(PROMPT, 6), "the other connection serves on"
    if case == "malformed blocks":
        assert node.agent.shared.agent.is_fenced(99) is False, "the session survives for a reconnect"


def test_unknown_droppable_frames_and_unhandled_types_are_skipped(node):
    with FleetHead.connect(node.addr) as head:
        head.endpoint.send(0x8003)  # droppable, and unknown to this node
        head.endpoint.send(msg_type.TELEMETRY, TelemetryMsg(spans=b"span"))
        head.endpoint.send(msg_type.POLICY_UPDATE, PolicyUpdateMsg(policy_version=3, envelope=b"x"))
        # Types the node does not act on are never decoded (as in the Rust node): a payload that
        # would not decode costs nothing there.
        head.endpoint.send_payload(msg_type.TELEMETRY, b"\xff")
        head.endpoint.send_payload(msg_type.PARK_REQ, b"\x01")
        head.assign(1, GenParams())
        head.append(1, PROMPT)
        assert head.generate(1, 4).tokens == mock_tokens(PROMPT, 4)
