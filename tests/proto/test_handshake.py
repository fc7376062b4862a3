"""handshake.rs's unit tests (version negotiation), ported, and HELLO's shape."""

from proto.handshake import Hello, LinkRole, negotiate
from proto.postcard import from_bytes, to_bytes


def test_negotiate_overlap_picks_highest_common():
    assert negotiate((1, 5), (3, 7)) == 5
    assert negotiate((1, 3), (1, 3)) == 3
    assert negotiate((1, 10), (10, 10)) == 10


def test_negotiate_no_overlap_is_none():
    assert negotiate((1, 2), (3, 4)) is None
    assert negotiate((5, 5), (1, 4)) is None


def test_negotiate_touching_ranges():
    assert negotiate((1, 3), (3, 5)) == 3


def test_public_head_and_this_node_agree_on_2():
    assert negotiate((2, 2), (2, 3)) == 2
    assert negotiate((2, 3), (2, 3)) == 3


def test_link_role_is_a_variant_index():
    assert [int(r) for r in (LinkRole.NodeAgent, LinkRole.Worker, LinkRole.HeadDaemon)] == [0, 1, 2]
    hello = Hello(proto_versions=(2, 2), link_role=LinkRole.HeadDaemon, auth=b"")
    assert to_bytes(hello) == bytes([2, 2, 2, 0])
    assert from_bytes(Hello, bytes([2, 2, 2, 0])).link_role is LinkRole.HeadDaemon
