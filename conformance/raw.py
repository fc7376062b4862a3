"""A link that writes bytes, not messages: for checks that break the protocol on purpose and
for replaying a transcript byte for byte.

`RawLink` is plain TCP, or Noise-wrapped when given a token, so bad input reaches a keyed node
too; what it reads back is split into frames by the envelope decoder.
"""

from __future__ import annotations

import select
import socket
import time

from linkf.driver import split_address
from linkf.errors import Closed, TimedOut
from linkf.message import Message
from linkf.secure import NoiseRole, SecureStream, key_from
from proto import postcard
from proto.envelope import FRAME_HEAD, HEADER_LEN, EnvelopeError, FrameDecoder
from proto.handshake import Hello, HelloAckF, LinkRole
from proto.linkf import is_known_type, msg_type

_READ = 64 * 1024


def raw_frame(
    msg_type_: int,
    payload: bytes = b"",
    *,
    version: int = 3,
    seq: int = 1,
    class_byte: int | None = None,
    length: int | None = None,
) -> bytes:
    """A frame's bytes, any field of which may be wrong on purpose."""
    if class_byte is None:
        class_byte = 1 if msg_type_ & 0x8000 else 0
    if length is None:
        length = HEADER_LEN + len(payload)
    return FRAME_HEAD.pack(length, version, msg_type_, seq, 0, class_byte) + payload


def raw_connect(addr: str, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(split_address(addr), timeout)
    sock.settimeout(timeout)
    return sock


def hung_up(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closes `sock` within `timeout`, reading (and dropping) what it sends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            if not sock.recv(_READ):
                return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True
    return False


class RawLink:
    """One connection whose bytes the caller writes; sealed with Noise when it has a token."""

    def __init__(self, sock: socket.socket, secure: SecureStream | None) -> None:
        self.sock = sock
        self._secure = secure
        self._decoder = FrameDecoder(is_known_type, frame_type=Message)
        self._seq = 1

    @classmethod
    def connect(cls, addr: str, auth: bytes = b"", *, noise: bool | None = None, timeout: float = 5.0) -> RawLink:
        """Dials `addr`; runs Noise as the initiator when `auth` is set (unless noise=False)."""
        sock = raw_connect(addr, timeout)
        secure = None
        if bool(auth) if noise is None else noise:
            secure = SecureStream.handshake(sock, key_from(bytes(auth)), NoiseRole.Initiator, timeout)
        sock.settimeout(None)
        return cls(sock, secure)

    def send(self, data: bytes) -> None:
        """Writes `data` as is (sealed on a Noise link)."""
        self.sock.sendall(data if self._secure is None else self._secure.seal(data))

    def send_msg(self, msg_type_: int, msg: object, version: int = 3) -> None:
        """A well-formed frame, numbered in turn."""
        payload = b"" if msg is None else postcard.to_bytes(msg)
        self.send(raw_frame(msg_type_, payload, version=version, seq=self._seq))
        self._seq += 1

    def hello(self, auth: bytes, versions: tuple[int, int] = (2, 3), timeout: float = 5.0) -> HelloAckF:
        """Says HELLO as a head; the node's answer."""
        hello = Hello(proto_versions=versions, link_role=LinkRole.HeadDaemon, auth=bytes(auth))
        self.send_msg(msg_type.HELLO, hello, version=versions[1])
        deadline = time.monotonic() + timeout
        while True:
            for frame in self.read(max(deadline - time.monotonic(), 0.001)):
                if frame.msg_type == msg_type.HELLO_ACK_F:
                    return frame.msg
            if time.monotonic() >= deadline:
                raise TimedOut("no HELLO_ACK_F")

    def read(self, timeout: float) -> list[Message]:
        """The frames one read brings within `timeout` (maybe none), as an endpoint's messages;
        Closed once the node hung up, or sent bytes that are no frame."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        if not poller.poll(max(int(timeout * 1000), 1)):
            return []
        try:
            data = self.sock.recv(_READ)
        except OSError as e:
            raise Closed(f"while receiving: {e}") from e
        if not data:
            raise Closed()
        self._decoder.feed(data if self._secure is None else self._secure.open(data))
        frames = []
        try:
            while (frame := self._decoder.decode_next()) is not None:
                frames.append(frame)
        except EnvelopeError as e:
            raise Closed(f"the node sent bytes that are no frame: {e}") from e
        return frames

    def hung_up(self, timeout: float) -> bool:
        """Whether the node closes the link within `timeout`, dropping what it sends meanwhile."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.read(deadline - time.monotonic())
            except Closed:
                return True
        return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawLink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
