"""Fault doubles for the conformance kit: a proxy in front of a real node that breaks exactly one
rule of the protocol, so a test can check the kit's suite reports it, and by the right scenario.

The proxy splits both directions into frames (plain links only; each a `Message`, its payload
decoded on reading `msg`) and hands each to its `Fault`, which returns the frames to pass on;
bytes that are no frame (the suite's bad input) pass as they are. `tick` lets a fault send
something of its own accord.
"""

from __future__ import annotations

import dataclasses
import select
import socket
import threading
import time

from linkf.driver import split_address
from linkf.message import Message
from proto import postcard
from proto.envelope import EnvelopeError, Frame, FrameDecoder, encode_frame
from proto.linkf import TokenEvent, TokenEventPayload, TokenEventsMsg, msg_type

DECLINED = 2**32 - 3
TICK_S = 0.05


class Link:
    """One proxied connection: the head's socket and the node's."""

    def __init__(self, head: socket.socket, node: socket.socket) -> None:
        self.head, self.node = head, node
        self.lock = threading.Lock()
        self.closed = threading.Event()

    def to_head(self, frames: list[Frame]) -> None:
        with self.lock:
            for f in frames:
                self.head.sendall(encode_frame(f))

    def close(self) -> None:
        self.closed.set()
        for s in (self.head, self.node):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Fault:
    """Passes everything as it is; a subclass breaks one rule."""

    def from_node(self, link: Link, frame: Frame) -> list[Frame]:
        return [frame]

    def from_head(self, link: Link, frame: Frame) -> list[Frame]:
        return [frame]

    def tick(self, link: Link) -> list[Frame]:
        return []


def events_frame(frame: Frame, events: list[TokenEvent]) -> Frame:
    """A TOKEN_EVENTS frame carrying `events`, with `frame`'s header otherwise."""
    payload = postcard.to_bytes(TokenEventsMsg(events=events))
    return dataclasses.replace(frame, msg_type=msg_type.TOKEN_EVENTS, payload=payload)


class NeverFinishes(Fault):
    """Sends a generation's tokens but never its Finish."""

    def from_node(self, link, frame):
        if frame.msg_type != msg_type.TOKEN_EVENTS:
            return [frame]
        events = [e for e in frame.msg.events
                  if not isinstance(e.payload, TokenEventPayload.Finish)]
        return [events_frame(frame, events)] if events else []


class ReusesEventSeq(Fault):
    """Numbers a generation's second event like its first: event_seq 0 goes out twice."""

    def from_node(self, link, frame):
        if frame.msg_type != msg_type.TOKEN_EVENTS:
            return [frame]
        events = [dataclasses.replace(e, event_seq=e.event_seq - 1) if e.event_seq >= 1 else e
                  for e in frame.msg.events]
        return [events_frame(frame, events)]


class WrongToken(Fault):
    """Answers every generation's first token one off."""

    def from_node(self, link, frame):
        if frame.msg_type != msg_type.TOKEN_EVENTS:
            return [frame]
        events = []
        for e in frame.msg.events:
            if e.event_seq == 0 and isinstance(e.payload, TokenEventPayload.Tokens) and e.payload.tokens:
                tokens = [(e.payload.tokens[0] + 1) % 32000, *e.payload.tokens[1:]]
                e = dataclasses.replace(e, payload=TokenEventPayload.Tokens(tokens=tokens))
            events.append(e)
        return [events_frame(frame, events)]


class IgnoresCancel(Fault):
    """Never lets a GENERATE_CANCEL reach the node."""

    def from_head(self, link, frame):
        return [] if frame.msg_type == msg_type.GENERATE_CANCEL else [frame]


class DropsOnDecline(Fault):
    """Hangs up where it should answer FINISH_DECLINED."""

    def from_node(self, link, frame):
        if frame.msg_type == msg_type.TOKEN_EVENTS and any(
            isinstance(e.payload, TokenEventPayload.Finish) and e.payload.reason == DECLINED
            for e in frame.msg.events
        ):
            link.close()
            return []
        return [frame]


class TokensAfterFence(Fault):
    """Sends one more token event 1.5 s after a short lease ran out ungranted."""

    def __init__(self) -> None:
        self.expiry: dict[int, float] = {}
        self.last: dict[int, TokenEvent] = {}
        self.version = 3

    def from_head(self, link, frame):
        msg = frame.msg if frame.msg_type in (
            msg_type.SESSION_ASSIGN, msg_type.LEASE_GRANT) else None
        if frame.msg_type == msg_type.SESSION_ASSIGN and msg.lease.duration_ms < 5_000:
            self.expiry[msg.session_id] = time.monotonic() + msg.lease.duration_ms / 1000
        elif frame.msg_type == msg_type.LEASE_GRANT and msg.session_id in self.expiry:
            self.expiry[msg.session_id] = time.monotonic() + msg.duration_ms / 1000
        return [frame]

    def from_node(self, link, frame):
        self.version = frame.proto_version
        if frame.msg_type == msg_type.TOKEN_EVENTS:
            for e in frame.msg.events:
                self.last[e.session_id] = e
        return [frame]

    def tick(self, link):
        due = [s for s, at in self.expiry.items() if time.monotonic() > at + 1.5 and s in self.last]
        out = []
        for s in due:
            del self.expiry[s]
            e = self.last[s]
            late = dataclasses.replace(e, event_seq=e.event_seq + 1, payload=TokenEventPayload.Tokens(tokens=[7]))
            payload = postcard.to_bytes(TokenEventsMsg(events=[late]))
            out.append(Frame(self.version, msg_type.TOKEN_EVENTS, 0, 0, 0, payload))
        return out


class RetransmitsAcked(Fault):
    """After a RECONCILE_ACK, sends again an event the head acknowledged (on any earlier link)."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int, int], dict[int, TokenEvent]] = {}
        self.acked: TokenEvent | None = None

    def from_node(self, link, frame):
        if frame.msg_type == msg_type.TOKEN_EVENTS:
            for e in frame.msg.events:
                self.sent.setdefault((e.session_id, e.epoch, e.generation_id), {})[e.event_seq] = e
        if frame.msg_type == msg_type.RECONCILE_ACK and self.acked is not None:
            return [frame, events_frame(frame, [self.acked])]
        return [frame]

    def from_head(self, link, frame):
        if frame.msg_type == msg_type.WATERMARK_ACK:
            ack = frame.msg
            sent = self.sent.get((ack.session_id, ack.epoch, ack.generation_id), {})
            self.acked = sent.get(ack.watermark, self.acked)
        return [frame]


class FaultProxy:
    """Listens on loopback and relays each connection to `upstream` through `fault`."""

    def __init__(self, upstream: str, fault: Fault) -> None:
        self.upstream = upstream
        self.fault = fault
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(TICK_S)
        self.addr = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._links: list[Link] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="fault-proxy")]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                head, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            link = Link(head, socket.create_connection(split_address(self.upstream), 5))
            self._links.append(link)
            for target in (self._from_head, self._from_node):
                t = threading.Thread(target=target, args=(link,), daemon=True, name="fault-proxy-link")
                self._threads.append(t)
                t.start()

    def _from_head(self, link: Link) -> None:
        def out(frames: list[Frame]) -> None:
            for f in frames:
                link.node.sendall(encode_frame(f))

        self._relay(link, link.head, link.node, self.fault.from_head, out, tick=False)

    def _from_node(self, link: Link) -> None:
        self._relay(link, link.node, link.head, self.fault.from_node, link.to_head, tick=True)

    def _relay(self, link: Link, src: socket.socket, dst: socket.socket, hook, out, tick: bool) -> None:
        decoder: FrameDecoder | None = FrameDecoder(lambda t: True, frame_type=Message)
        pending = bytearray()  # what came in and has not left as a frame yet
        try:
            while not link.closed.is_set():
                if tick:
                    link.to_head(self.fault.tick(link))
                if not select.select([src], [], [], TICK_S)[0]:
                    continue
                data = src.recv(65536)
                if not data:
                    break
                if decoder is None:
                    dst.sendall(data)
                    continue
                pending += data
                decoder.feed(data)
                try:
                    while (frame := decoder.decode_next()) is not None:
                        del pending[: 25 + len(frame.payload)]
                        out(hook(link, frame))
                except EnvelopeError:
                    # Bytes that are no frame (bad input on purpose): from here on, as they are.
                    dst.sendall(bytes(pending))
                    decoder = None
        except OSError:
            pass
        finally:
            link.close()

    def stop(self) -> None:
        self._stop.set()
        for link in self._links:
            link.close()
        for t in self._threads:
            t.join(5)
        self._listener.close()
