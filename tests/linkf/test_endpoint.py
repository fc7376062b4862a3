"""linkf.driver.Endpoint over socketpairs and loopback TCP: the handshake, versions, liveness,
and Noise. Every blocking step has a timeout, so a bug fails instead of hanging."""

import socket
import time

import pytest
from linkpairs import ackf, messages_until, tcp_pair, unix_pair
from polling import TIMEOUT, background

from linkf import (
    Closed,
    Endpoint,
    Envelope,
    Io,
    LinkFError,
    Liveness,
    Payload,
    Protocol,
    TimedOut,
    Unauthorized,
)
from proto.envelope import FrameClass
from proto.handshake import Hello, LinkRole
from proto.linkf import LeaseRenewMsg, TelemetryMsg, msg_type


def handshake(head, node, versions=(2, 3), auth=b"", expected=b""):
    served = background(lambda: node.answer_hello_as_agent(ackf(), expected, TIMEOUT))
    ack = head.hello_as_head(auth, TIMEOUT, versions)
    served()
    return ack


@pytest.mark.parametrize("make", [unix_pair, tcp_pair], ids=["unix", "tcp"])
def test_hello_both_ways_then_frames_carry_seq_and_version(make):
    head, node = make()
    ack = handshake(head, node)
    assert ack.node_identity == "node"
    assert ack.chosen_version == 3
    assert head.version() == node.version() == 3
    head.send(msg_type.LEASE_RENEW, LeaseRenewMsg(session_id=7, epoch=2))
    (message,) = messages_until(node, msg_type.LEASE_RENEW)
    assert (message.seq, message.proto_version, message.correlation_id) == (2, 3, 0), "HELLO was seq 1"
    assert message.msg == LeaseRenewMsg(session_id=7, epoch=2)
    node.send(msg_type.TELEMETRY, TelemetryMsg(spans=b"x"))
    (message,) = messages_until(head, msg_type.TELEMETRY)
    assert message.seq == 2 and message.class_ == FrameClass.DROPPABLE
    assert message.msg == TelemetryMsg(spans=b"x")
    assert "unix" in node.peer or "127.0.0.1:" in node.peer


@pytest.mark.parametrize("versions, chosen", [((2, 2), 2), ((2, 3), 3), ((3, 9), 3), ((1, 2), 2)])
def test_versions_negotiate_to_the_highest_common(versions, chosen):
    head, node = unix_pair()
    raw = []
    node_open = node._io.open
    node._io.open = lambda data: raw.append(node_open(data)) or raw[-1]
    assert handshake(head, node, versions).chosen_version == chosen
    assert head.version() == node.version() == chosen
    assert int.from_bytes(raw[0][4:6], "little") == versions[1], "HELLO goes out at the head's highest"


def refused(versions=(2, 3), role=LinkRole.HeadDaemon, auth=b"", expected=b""):
    """The node's error and what the head saw, for a HELLO the node refuses."""
    head, node = unix_pair()

    def serve():
        try:
            node.answer_hello_as_agent(ackf(), expected, TIMEOUT)
        finally:
            node.close()

    served = background(serve)
    with pytest.raises(Closed):
        head.hello_as_head(auth, TIMEOUT, versions, role)
    with pytest.raises(LinkFError) as err:
        served()
    return err.value


def test_no_common_version_is_refused():
    err = refused(versions=(4, 5))
    assert isinstance(err, Protocol) and err.reason == "no common proto version"


@pytest.mark.parametrize("role", [LinkRole.NodeAgent, LinkRole.Worker])
def test_a_peer_that_is_not_a_head_is_refused(role):
    err = refused(role=role)
    assert isinstance(err, Protocol) and err.reason == "peer is not a head daemon"


def test_the_version_is_checked_before_the_role():
    err = refused(versions=(4, 5), role=LinkRole.Worker)
    assert err.reason == "no common proto version"


def test_wrong_auth_is_unauthorized_and_the_right_one_served():
    err = refused(auth=b"other", expected=b"token")
    assert isinstance(err, Unauthorized)
    assert "unix" in str(err)
    assert isinstance(refused(auth=b"", expected=b"token"), Unauthorized)
    head, node = unix_pair()
    assert handshake(head, node, auth=b"token", expected=b"token").node_identity == "node"


def test_a_node_without_a_token_takes_any_auth():
    head, node = unix_pair()
    assert handshake(head, node, auth=b"whatever").chosen_version == 3


def test_a_silent_head_times_the_hello_out():
    _head, node = unix_pair()
    t0 = time.monotonic()
    with pytest.raises(TimedOut):
        node.answer_hello_as_agent(ackf(), b"", 0.2)
    assert 0.2 <= time.monotonic() - t0 < 2


def test_a_frame_other_than_hello_first_is_a_protocol_error():
    head, node = unix_pair()
    head.send(msg_type.LEASE_RENEW, LeaseRenewMsg())
    with pytest.raises(Protocol, match="expected Hello"):
        node.answer_hello_as_agent(ackf(), b"", TIMEOUT)


def test_a_hello_that_does_not_decode_is_a_payload_error():
    head, node = unix_pair()
    head.send(msg_type.HELLO, TelemetryMsg(spans=b"\x07\x07\x07"))
    with pytest.raises(Payload):
        node.answer_hello_as_agent(ackf(), b"", TIMEOUT)


def test_a_payload_is_decoded_when_read_so_an_unread_bad_one_costs_nothing():
    head, node = unix_pair()
    head.send_payload(msg_type.POLICY_UPDATE, b"\x01\xff")  # its `envelope` length runs past the end
    head.send(msg_type.LEASE_RENEW, LeaseRenewMsg(session_id=3, epoch=1))
    bad, good = messages_until(node, msg_type.LEASE_RENEW)
    assert bad.msg_type == msg_type.POLICY_UPDATE and bad.payload == b"\x01\xff"
    assert good.msg is good.msg == LeaseRenewMsg(session_id=3, epoch=1), "decoded once"
    with pytest.raises(Payload, match=r"POLICY_UPDATE \(0x0007\)") as raised:
        _ = bad.msg
    assert raised.value.peer == node.peer


def test_frames_that_follow_the_hello_in_the_same_read_are_kept():
    head, node = unix_pair()
    head.send(msg_type.TELEMETRY, TelemetryMsg(spans=b"before"))
    head.send(msg_type.HELLO, Hello(proto_versions=(2, 3), link_role=LinkRole.HeadDaemon))
    head.send(msg_type.LEASE_RENEW, LeaseRenewMsg(session_id=3, epoch=1))  # in the socket on return
    node.answer_hello_as_agent(ackf(), b"", TIMEOUT)
    messages = messages_until(node, msg_type.LEASE_RENEW)
    assert [m.msg_type for m in messages] == [msg_type.LEASE_RENEW]
    assert messages[0].msg == LeaseRenewMsg(session_id=3, epoch=1)


def beats(ep, seconds):
    """Arrival times of the KEEPALIVEs ``ep`` receives over ``seconds``; other frames too."""
    times, others = [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for m in ep.pump():
            (times if m.msg_type == msg_type.KEEPALIVE else others).append(time.monotonic())
    return times, others


def idle_node(node, seconds):
    """Pumps ``node`` for ``seconds`` on a thread (as the serve loop does)."""

    def loop():
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            node.pump()

    return background(loop)


def sent_keepalives(ep):
    """Records when ``ep`` writes each KEEPALIVE frame."""
    times = []
    seal = ep._io.seal

    def tapped(data):
        if int.from_bytes(data[6:8], "little") == msg_type.KEEPALIVE:
            times.append(time.monotonic())
        return seal(data)

    ep._io.seal = tapped
    return times


def test_heartbeats_appear_on_an_idle_v3_link_never_more_often_than_the_heartbeat():
    head, node = unix_pair()
    handshake(head, node)
    node.keep_alive(Liveness(heartbeat=0.1, silence=0))
    sent = sent_keepalives(node)
    done = idle_node(node, 0.65)
    received, others = beats(head, 0.75)
    done()
    assert 3 <= len(sent) <= 7, sent
    assert len(received) == len(sent) and others == []
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert min(gaps) >= 0.1, gaps


def test_no_heartbeat_while_other_frames_flow():
    head, node = unix_pair()
    handshake(head, node)
    node.keep_alive(Liveness(heartbeat=0.3, silence=0))

    def busy():
        deadline = time.monotonic() + 0.7
        while time.monotonic() < deadline:
            node.send(msg_type.TELEMETRY, TelemetryMsg())
            node.pump()
            time.sleep(0.02)

    done = background(busy)
    times, others = beats(head, 0.75)
    done()
    assert times == [] and len(others) > 10


def test_a_v2_link_sends_no_heartbeat_and_never_times_out():
    head, node = unix_pair()
    handshake(head, node, versions=(2, 2))
    node.keep_alive(Liveness(heartbeat=0.05, silence=0.15))
    done = idle_node(node, 0.4)
    times, others = beats(head, 0.45)
    done()  # raises if the node timed out
    assert times == [] and others == []


def test_silence_times_a_v3_link_out():
    head, node = unix_pair()
    handshake(head, node)
    node.keep_alive(Liveness(heartbeat=10, silence=0.3))
    t0 = time.monotonic()
    with pytest.raises(TimedOut) as err:
        while time.monotonic() - t0 < TIMEOUT:
            node.pump()
    # The silence counts from the last frame heard (the handshake, before t0), so the time since
    # t0 may fall short of 0.3 s on a loaded machine; what must hold is the silence itself.
    assert time.monotonic() - t0 < 1.5
    assert node.quiet_for() >= 0.3
    assert "nothing heard" in str(err.value)


def test_heartbeats_keep_a_v3_link_alive():
    head, node = unix_pair()
    handshake(head, node)
    head.keep_alive(Liveness(heartbeat=0.05, silence=0))
    node.keep_alive(Liveness(heartbeat=10, silence=0.5))
    done = background(lambda: beats(head, 1.1))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        node.pump()  # raises TimedOut if the head's heartbeats did not count
    assert node.quiet_for() < 0.5
    done()


def test_peer_closing_is_closed_and_garbage_is_an_envelope_error():
    head, node = unix_pair()
    head.close()
    with pytest.raises(Closed):
        node.wait_messages()
    a, b = socket.socketpair()
    node = Endpoint.from_unix(b)
    a.sendall(b"\x01\x00\x00\x00" + bytes(30))
    with pytest.raises(Envelope):
        node.wait_messages()


def test_shutdown_from_another_thread_unblocks_wait_messages():
    head, node = unix_pair()
    waiting = background(node.wait_messages)
    time.sleep(0.1)
    node.shutdown()
    with pytest.raises(Closed):
        waiting()
    node.shutdown()


def test_connect_tcp_to_nothing_is_an_error():
    with socket.create_server(("127.0.0.1", 0)) as s:
        addr = s.getsockname()
    with pytest.raises(Io):
        Endpoint.connect_tcp(f"{addr[0]}:{addr[1]}", TIMEOUT)


def test_hear_within_lets_the_peer_wait_until_the_waker_or_the_limit_then_reads_it():
    from linkf.waker import Waker

    head, node = unix_pair()
    handshake(head, node)
    waker = Waker()
    node.wake_on(waker)
    head.send(msg_type.LEASE_RENEW, LeaseRenewMsg(session_id=1, epoch=1))  # there before the pump begins
    t0 = time.monotonic()
    (message,) = node.pump(TIMEOUT, hear_within=0.3)
    assert time.monotonic() - t0 >= 0.25, "the peer's bytes must not end the wait"
    assert message.msg == LeaseRenewMsg(session_id=1, epoch=1)
    head.send(msg_type.LEASE_RENEW, LeaseRenewMsg(session_id=2, epoch=1))
    waker.set()
    t0 = time.monotonic()
    (message,) = node.pump(TIMEOUT, hear_within=TIMEOUT)
    assert time.monotonic() - t0 < 0.2, "the waker ends the wait, and the frame is read with it"
    assert message.msg == LeaseRenewMsg(session_id=2, epoch=1)
    assert node.pump(0.1, hear_within=0.1) == []
    head.close()
    with pytest.raises(Closed):
        node.pump(TIMEOUT, hear_within=0.1)
