"""Noise: the unit tests of secure.rs, ported, the refusal's details, and Noise under an
`Endpoint` (right and wrong token, what crosses the wire, a plain or silent peer)."""

import socket
import threading

import pytest
from linkpairs import ackf, messages_until
from polling import TIMEOUT, background

from linkf import Endpoint
from linkf.errors import Closed, TimedOut, Unauthorized
from linkf.secure import MAX_PLAINTEXT, TAG, NoiseRole, SecureStream, key_from
from proto.handshake import Hello, LinkRole
from proto.linkf import TelemetryMsg, msg_type


def pair(a, b):
    x, y = socket.socketpair()
    responder = background(lambda: SecureStream.handshake(y, key_from(b), NoiseRole.Responder, TIMEOUT))
    initiator = SecureStream.handshake(x, key_from(a), NoiseRole.Initiator, TIMEOUT)
    return initiator, responder


def recv_exact(stream, n):
    stream.sock.settimeout(TIMEOUT)
    got = bytearray()
    while len(got) < n:
        chunk = stream.sock.recv(65536)
        assert chunk, "closed early"
        got += stream.open(chunk)
    return bytes(got)


def send(stream, data):
    stream.sock.sendall(stream.seal(data))


def test_one_token_both_ways_carries_small_and_large_messages():
    head, node = pair(b"token", b"token")
    node = node()
    big = bytes(i % 251 for i in range(200_000))

    def writer():
        send(head, b"hello")
        send(head, big)
        return recv_exact(head, 3)

    reply = background(writer)
    got = recv_exact(node, 5 + len(big))
    assert got[:5] == b"hello"
    assert got[5:] == big
    send(node, b"ack")
    assert reply() == b"ack"


def test_another_token_is_refused_at_the_handshake():
    x, y = socket.socketpair()
    node = background(lambda: SecureStream.handshake(y, key_from(b"other"), NoiseRole.Responder, TIMEOUT))
    # The initiator sees the responder hang up instead of answering.
    with pytest.raises(Closed):
        SecureStream.handshake(x, key_from(b"token"), NoiseRole.Initiator, TIMEOUT)
    with pytest.raises(Unauthorized) as refused:
        node()
    assert "fleet token differs" in str(refused.value)


def test_the_responder_refuses_on_the_first_message_and_writes_nothing():
    head_sock, node_sock, wire = tapped_pair()
    node = background(lambda: SecureStream.handshake(node_sock, key_from(b"other"), NoiseRole.Responder, TIMEOUT))
    with pytest.raises(Closed):
        SecureStream.handshake(head_sock, key_from(b"token"), NoiseRole.Initiator, TIMEOUT)
    with pytest.raises(Unauthorized):
        node()
    assert len(wire.head) == 2 + 48, "the head wrote exactly Noise message 1"
    assert wire.node == b"", "the refusing node wrote something"
    assert node_sock.fileno() == -1, "the refused socket was kept open"


def test_a_silent_peer_times_the_handshake_out():
    x, _y = socket.socketpair()
    with pytest.raises(TimedOut):
        SecureStream.handshake(x, key_from(b"token"), NoiseRole.Responder, 0.2)


class Wire:
    def __init__(self):
        self.head = bytearray()
        self.node = bytearray()


def relay(head_side, node_side, wire):
    """Copies bytes both ways between two sockets, keeping a copy of what each side writes."""

    def copy(src, dst, log):
        src.settimeout(TIMEOUT)
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                log.extend(data)
                dst.sendall(data)
            except OSError:
                break
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    threading.Thread(target=copy, args=(head_side, node_side, wire.head), daemon=True).start()
    threading.Thread(target=copy, args=(node_side, head_side, wire.node), daemon=True).start()


def tapped_pair():
    """head <-> relay <-> node; the relay keeps a copy of the bytes each side writes."""
    head_sock, relay_head = socket.socketpair()
    relay_node, node_sock = socket.socketpair()
    wire = Wire()
    relay(relay_head, relay_node, wire)
    return head_sock, node_sock, wire


def test_the_wire_is_not_the_plaintext():
    head_sock, node_sock, wire = tapped_pair()
    key = key_from(b"token")
    node = background(lambda: SecureStream.handshake(node_sock, key, NoiseRole.Responder, TIMEOUT))
    head = SecureStream.handshake(head_sock, key, NoiseRole.Initiator, TIMEOUT)
    send(head, b"a secret prompt")
    assert recv_exact(node(), 15) == b"a secret prompt"
    assert len(wire.head) > 15 + 2 + TAG, "the wire carried the handshake and one framed message"
    assert b"a secret prompt" not in bytes(wire.head), "the plaintext is on the wire"


def test_plaintext_is_cut_into_noise_sized_pieces():
    head, node = pair(b"token", b"token")
    node = node()
    data = bytes(MAX_PLAINTEXT + 1)
    sent = background(lambda: send(head, data))
    node.sock.settimeout(TIMEOUT)
    raw = bytearray()
    while len(raw) < 2 * (2 + TAG) + len(data):
        raw += node.sock.recv(1 << 20)
    sent()
    first = int.from_bytes(raw[:2], "big")
    assert first == MAX_PLAINTEXT + TAG
    second = int.from_bytes(raw[2 + first : 4 + first], "big")
    assert second == 1 + TAG


def test_a_first_message_too_short_to_be_noise_is_refused():
    x, y = socket.socketpair()
    node = background(lambda: SecureStream.handshake(y, key_from(b"token"), NoiseRole.Responder, TIMEOUT))
    x.sendall(b"\x00\x03abc")
    with pytest.raises(Unauthorized):
        node()


# Noise under an Endpoint


def secure_node(listener, secret, serve=True, handshake_timeout=TIMEOUT):
    """Accepts one connection as a Noise responder and answers its HELLO."""

    def accept():
        sock, _ = listener.accept()
        node = Endpoint.from_tcp_secure(sock, secret, NoiseRole.Responder, handshake_timeout)
        if serve:
            node.answer_hello_as_agent(ackf("secure-node"), secret, TIMEOUT)
        return node

    return background(accept)


def test_the_right_token_is_served_and_another_refused():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(TIMEOUT)
        addr = listener.getsockname()
        node = secure_node(listener, b"token")
        head = Endpoint.connect_tcp_secure(addr, b"token", TIMEOUT, TIMEOUT)
        assert head.hello_as_head(b"token", TIMEOUT).node_identity == "secure-node"
        node()

        node = secure_node(listener, b"token")
        with pytest.raises(Closed):
            Endpoint.connect_tcp_secure(addr, b"other", TIMEOUT, TIMEOUT)
        with pytest.raises(Unauthorized) as err:
            node()
        assert "127.0.0.1:" in str(err.value)


def tcp_relay(target):
    """A loopback listener that forwards to ``target`` and keeps every byte either side writes."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT)
    wire = Wire()

    def serve():
        with listener:
            inside, _ = listener.accept()
        outside = socket.create_connection(target, TIMEOUT)
        relay(inside, outside, wire)

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname(), wire


def test_the_plaintext_never_crosses_the_wire_and_a_1mib_frame_does_intact():
    marker = b"PLAINTEXT-MARKER-7f3a"
    big = bytes((i * 7919) % 256 for i in range(1 << 20))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(TIMEOUT)
        node = secure_node(listener, b"token")
        addr, wire = tcp_relay(listener.getsockname())
        head = Endpoint.connect_tcp_secure(addr, b"token", TIMEOUT, TIMEOUT)
        head.hello_as_head(b"token", TIMEOUT)
        node = node()
        head.send(msg_type.TELEMETRY, TelemetryMsg(spans=marker))
        sent = background(lambda: head.send(msg_type.TELEMETRY, TelemetryMsg(spans=big)))
        messages = []
        while len(messages) < 2:
            messages += messages_until(node, msg_type.TELEMETRY)
        sent()
        got = [m.msg.spans for m in messages]
        assert got == [marker, big]
    carried = bytes(wire.head + wire.node)
    assert len(carried) > len(big)
    assert marker not in carried
    assert b"token" not in carried
    assert big[:4096] not in carried


def test_a_plain_peer_cannot_talk_to_a_secure_node():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(TIMEOUT)
        node = secure_node(listener, b"token", serve=False, handshake_timeout=0.3)
        head = Endpoint.connect_tcp(listener.getsockname(), TIMEOUT)
        # Its frame's length prefix reads as a Noise message far longer than it sends.
        head.send(msg_type.HELLO, Hello(proto_versions=(2, 3), link_role=LinkRole.HeadDaemon, auth=b"token"))
        with pytest.raises(TimedOut):
            node()


def test_a_silent_peer_times_the_noise_handshake_out():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        dialled = socket.create_connection(listener.getsockname(), TIMEOUT)
        accepted, _ = listener.accept()
        with pytest.raises(TimedOut):
            Endpoint.from_tcp_secure(accepted, b"token", NoiseRole.Responder, 0.2)
        assert accepted.fileno() == -1, "a failed handshake keeps its socket open"
        dialled.close()
