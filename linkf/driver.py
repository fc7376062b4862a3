"""A framed Link F endpoint over a byte stream (TCP, Unix, or Noise over TCP): the I/O that
runs the pure state machines of ``agent`` and ``head`` against a real peer.

It numbers frames, negotiates the version in the HELLO exchange and keeps a version-3 link
alive: a KEEPALIVE whenever nothing was sent for the heartbeat, ``TimedOut`` once the peer has
been silent for the silence limit. A version-2 link does neither, as the Rust node it
replaces: a v2 head does not expect them. Durations here are float seconds.

Reads wait in poll(2) for as long as the caller says, together with an optional ``Waker`` that
other threads make readable, so a loop can sleep until the peer speaks, a worker has output, or
its next deadline, whichever comes first. Writes go out on a non-blocking socket: a peer that
takes no bytes for the write timeout is ``TimedOut``, and the endpoint is unusable from then on
(a frame may have left in part).

What it receives comes back as ``Message``s, frames whose payloads decode as the catalog's
types on first read (``message.py`` says why not sooner): ``send`` takes a message and ``pump``
gives messages, so no caller decodes a payload itself.

One thread uses an endpoint: its connection's own. ``shutdown`` alone may come from another,
to unblock it; other threads hand that one their output (its ``Waker``) and never touch the
socket.
"""

from __future__ import annotations

import dataclasses
import errno
import hmac
import math
import select
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from proto import postcard
from proto.envelope import MAX_FRAME, EnvelopeError, Frame, FrameClass, FrameDecoder, encode_frame, foreign_protocol
from proto.handshake import MAX_HELLO_FRAME, Hello, HelloAckF, LinkRole, negotiate
from proto.linkf import is_known_type, msg_type

from . import gil_held
from .budget import PROCESS_BUDGET, BufferBudget
from .errors import Closed, Envelope, Io, LinkFError, Payload, Protocol, TimedOut, Unauthorized
from .message import Message
from .secure import LINKF_ONLY, NoiseRole, SecureStream, key_from
from .waker import Waker

PROTO_VERSION = 3
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_POLL = 0.020
#: A wait with no deadline: poll(2) still returns for the peer, a waker or a shutdown.
_FOREVER = 3600.0
_READ = 64 * 1024
_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ECONNABORTED, errno.ENOTCONN, errno.EBADF)


@dataclass(frozen=True)
class Liveness:
    """``heartbeat``: send a KEEPALIVE after this long without sending anything.
    ``silence``: give up on a peer heard nothing from for this long; 0 = never."""

    heartbeat: float
    silence: float


#: A link's liveness until the caller sets its own: a heartbeat every 5 s, no silence limit.
DEFAULT_LIVENESS = Liveness(heartbeat=5.0, silence=0.0)


class _Plain:
    """A connected socket whose bytes go on the wire as they are (``SecureStream`` is the
    encrypted twin)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def seal(self, data: bytes) -> bytes:
        return data

    def open(self, data: bytes) -> bytes:
        return data


def _nodelay(sock: socket.socket) -> None:
    """Frames leave at once. A socket too dead for this fails its first read or write instead."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


def show_address(addr: tuple) -> str:
    """A socket address as Rust prints a `SocketAddr`: `1.2.3.4:5`, `[::1]:5`."""
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _peer_of(sock: socket.socket) -> str:
    try:
        addr = sock.getpeername()
    except OSError:
        return "unknown peer"
    if isinstance(addr, tuple):
        return show_address(addr)
    return f"unix:{addr}" if addr else "unix socket"


def split_address(addr: str | tuple[str, int]) -> tuple[str, int]:
    """(host, port) of `host:port` or `[v6]:port`, the brackets taken off; a tuple as it is."""
    if isinstance(addr, tuple):
        return addr
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class Endpoint:
    def __init__(self, stream: _Plain | SecureStream, peer: str) -> None:
        self._io = stream
        self.peer = peer
        self._decoder = FrameDecoder(is_known_type, frame_type=Message)
        self._holding = PROCESS_BUDGET.holding()
        self._pending: deque[Message] = deque()
        #: Called with ("sent" or "received", frame) for every frame that passes, payloads in
        #: the clear: how `superfluid-noded --record` writes transcripts.
        self.recorder: Callable[[str, Frame], None] | None = None
        self._seq = 1
        self._version: int | None = None
        self._hello_version = PROTO_VERSION
        self._poll = DEFAULT_POLL
        self._liveness = DEFAULT_LIVENESS
        self._last_sent = self._last_heard = time.monotonic()
        self._write_timeout: float | None = None
        #: Set once a write failed: a frame may have left in part, so nothing more can follow.
        self._broken: LinkFError | None = None
        self._sock = stream.sock
        self._sock.setblocking(False)
        self._readable = select.poll()
        self._readable.register(self._sock, select.POLLIN)
        self._waker: Waker | None = None
        #: The waker alone, for a pump whose caller lets the peer's bytes wait (``hear_within``).
        self._wakeable = select.poll()

    # Construction

    @classmethod
    def from_tcp(cls, sock: socket.socket) -> Endpoint:
        _nodelay(sock)
        return cls(_Plain(sock), _peer_of(sock))

    @classmethod
    def from_unix(cls, sock: socket.socket) -> Endpoint:
        return cls(_Plain(sock), _peer_of(sock))

    @classmethod
    def from_tcp_secure(
        cls, sock: socket.socket, secret: bytes, role: NoiseRole, handshake_timeout: float | None
    ) -> Endpoint:
        """Noise over ``sock``, keyed by ``secret``; the head is the initiator. A peer with
        another secret is ``Unauthorized`` (the initiator sees the refusing peer hang up:
        ``Closed``); no handshake within ``handshake_timeout`` (None or 0: no limit) is
        ``TimedOut``. ``sock`` is closed when the handshake fails."""
        _nodelay(sock)
        peer = _peer_of(sock)
        return cls(SecureStream.handshake(sock, key_from(secret), role, handshake_timeout, peer), peer)

    @classmethod
    def connect_tcp(cls, addr: str | tuple[str, int], timeout: float | None) -> Endpoint:
        """Dials ``addr`` (``"host:port"`` or a tuple) within ``timeout`` seconds."""
        return cls.from_tcp(_dial(addr, timeout))

    @classmethod
    def connect_tcp_secure(
        cls, addr: str | tuple[str, int], secret: bytes, timeout: float | None, handshake_timeout: float | None
    ) -> Endpoint:
        """Dials ``addr`` and runs Noise as the initiator, as a head does."""
        return cls.from_tcp_secure(_dial(addr, timeout), secret, NoiseRole.Initiator, handshake_timeout)

    # Settings

    def version(self) -> int:
        """The negotiated version; before the handshake, the one HELLO goes out with."""
        return self._hello_version if self._version is None else self._version

    def poll_every(self, seconds: float) -> None:
        """How long one ``pump`` waits for bytes."""
        if seconds <= 0:
            raise ValueError(f"poll interval must be positive, got {seconds}")
        self._poll = seconds

    def fileno(self) -> int:
        """The socket's descriptor, for a caller that waits on many endpoints in one poll and
        then pumps those that are readable with no wait."""
        return self._sock.fileno()

    def keep_alive(self, liveness: Liveness) -> None:
        self._liveness = liveness

    @property
    def broken(self) -> LinkFError | None:
        """Why a write failed, after which nothing more can be sent; None while none has."""
        return self._broken

    def write_timeout(self, seconds: float | None) -> None:
        """How long a write may wait for the peer to take a byte (None: forever)."""
        self._write_timeout = seconds

    def wake_on(self, waker: Waker | None) -> None:
        """``pump`` also returns, maybe with no frame, once ``waker`` is set; None stops that."""
        if self._waker is not None:
            self._readable.unregister(self._waker)
            self._wakeable.unregister(self._waker)
        self._waker = waker
        if waker is not None:
            self._readable.register(waker, select.POLLIN)
            self._wakeable.register(waker, select.POLLIN)

    def buffer_budget(self, budget: BufferBudget) -> None:
        """Counts this endpoint's incomplete frames against `budget` instead of the process's."""
        self._holding.release()
        self._holding = budget.holding()

    def quiet_for(self) -> float:
        """Seconds since anything was received."""
        return time.monotonic() - self._last_heard

    # Messages

    def send(self, msg_type_: int, msg: object = None) -> None:
        """Sends ``msg`` (a postcard struct; None for an empty payload) as the next frame."""
        self.send_payload(msg_type_, self._encode(msg_type_, msg))

    def send_payload(self, msg_type_: int, payload: bytes) -> None:
        """Sends an already encoded payload as the next frame: for one message many links
        send alike, encoded once."""
        self._write(self._next_frame(msg_type_, payload))

    def pump(self, timeout: float | None = None, hear_within: float | None = None) -> list[Message]:
        """One read, waiting at most ``timeout`` seconds (None: the poll interval) and less when
        a heartbeat or the silence limit comes first, then a message for every complete frame.
        Returns early, maybe with none, when the waker is set. Sends a heartbeat when one is due
        and, on a version-3 link, fails with ``TimedOut`` once the peer has been silent too long.

        ``hear_within`` (with a waker): the peer's bytes do not wake the wait, which lasts at
        most that long, and are read without waiting once it ends. A loop whose worker wakes it
        often takes the peer's replies in the pass its next output wakes, not in a wake of their
        own: on a busy machine each thread wake-up is time taken from the engine. What the
        handshake read past its answer comes back first, without a wait."""
        if self._pending:
            messages = list(self._pending)
            self._pending.clear()
            return messages
        if self._broken is not None:
            raise self._broken
        self._beat()
        wait = min(self._poll if timeout is None else timeout, self._until_liveness())
        if hear_within is not None and self._waker is not None:
            readable = self._wait(min(wait, hear_within), self._wakeable)
        else:
            readable = self._wait(wait, self._readable)
        if readable:
            self._read()
        messages = self._received()
        silence = self._liveness.silence
        if not messages and self._v3() and silence > 0 and self.quiet_for() >= silence:
            raise TimedOut(f"nothing heard for {self.quiet_for():.1f} s", peer=self.peer)
        return messages

    def wait_messages(self) -> list[Message]:
        """Blocks until at least one message arrives (Rust's ``wait_frames``)."""
        while True:
            messages = self.pump(_FOREVER)
            if messages:
                return messages

    # Handshake

    def hello_as_head(
        self,
        auth: bytes,
        timeout: float | None = None,
        versions: tuple[int, int] = SUPPORTED_VERSIONS,
        role: LinkRole = LinkRole.HeadDaemon,
    ) -> HelloAckF:
        """Sends HELLO offering ``versions`` and returns the node's HELLO_ACK_F; the link then
        runs at the version the node chose. ``timeout`` None waits forever."""
        deadline = _deadline(timeout)
        self._hello_version = versions[1]
        self.send(msg_type.HELLO, Hello(proto_versions=(versions[0], versions[1]), link_role=role, auth=bytes(auth)))
        ack: HelloAckF = self._first(msg_type.HELLO_ACK_F, "expected HelloAckF", deadline).msg
        if not versions[0] <= ack.chosen_version <= versions[1]:
            raise Protocol("peer chose a version that was not offered", peer=self.peer)
        self._version = ack.chosen_version
        return ack

    def answer_hello_as_agent(self, ack: HelloAckF, expected_auth: bytes, timeout: float | None = None) -> None:
        """Waits for the head's HELLO, checks it (a common version, the head's role, the
        fleet token when ``expected_auth`` is non-empty) and answers ``ack`` carrying the
        negotiated version. ``timeout`` None waits forever. Until HELLO has come, a frame longer
        than ``MAX_HELLO_FRAME`` is an ``Envelope`` error."""
        self._decoder.max_frame = MAX_HELLO_FRAME
        try:
            message = self._first(msg_type.HELLO, "expected Hello", _deadline(timeout))
        except Envelope:
            foreign = foreign_protocol(self._decoder.peek(8))
            if foreign is None:
                raise
            raise Protocol(f"the peer speaks {foreign}; {LINKF_ONLY}", peer=self.peer) from None
        self._decoder.max_frame = MAX_FRAME
        hello: Hello = message.msg
        version = negotiate(hello.proto_versions, SUPPORTED_VERSIONS)
        if version is None:
            raise Protocol("no common proto version", peer=self.peer)
        if hello.link_role != LinkRole.HeadDaemon:
            raise Protocol("peer is not a head daemon", peer=self.peer)
        if expected_auth and not hmac.compare_digest(bytes(hello.auth), bytes(expected_auth)):
            raise Unauthorized("its HELLO carries another fleet token", peer=self.peer)
        self._version = version
        self.send(msg_type.HELLO_ACK_F, dataclasses.replace(ack, chosen_version=version))

    # Teardown

    def shutdown(self) -> None:
        """Ends the connection both ways; a ``pump`` blocked on another thread then raises
        ``Closed``. Safe to call more than once."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self._holding.release()
        self._sock.close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Internals

    def _v3(self) -> bool:
        return self._version is not None and self._version >= 3

    def _beat(self) -> None:
        heartbeat = self._liveness.heartbeat
        if self._v3() and heartbeat > 0 and time.monotonic() - self._last_sent >= heartbeat:
            self.send(msg_type.KEEPALIVE)

    def _until_liveness(self) -> float:
        """Seconds until the next heartbeat is due or the peer's silence runs out (v3 only)."""
        if not self._v3():
            return _FOREVER
        now = time.monotonic()
        heartbeat, silence = self._liveness.heartbeat, self._liveness.silence
        due = [self._last_sent + heartbeat - now] if heartbeat > 0 else []
        if silence > 0:
            due.append(self._last_heard + silence - now)
        return max(min(due, default=_FOREVER), 0.0)

    def _wait(self, timeout: float, waiting: select.poll) -> bool:
        """Waits until ``waiting`` says so or ``timeout`` ends (or the waker is set); whether
        to read. A ``waiting`` without the socket (``_wakeable``) reads whatever has come,
        without waiting for more."""
        wait_ms = math.ceil(max(timeout, 0.0) * 1000)
        if wait_ms <= 0:  # a zero-time poll would only let go of the GIL (`gil_held`)
            return True
        try:
            ready = waiting.poll(wait_ms)  # retried on EINTR by Python itself (PEP 475)
        except (OSError, ValueError) as e:
            raise self._io_error("receiving", e) from e
        return waiting is not self._readable or any(fd == self._sock.fileno() for fd, _ in ready)

    def _read(self) -> None:
        """Feeds the decoder what one read brings, without waiting."""
        try:
            data = gil_held.recv(self._sock, _READ)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ValueError) as e:
            raise self._io_error("receiving", e) from e
        if not data:
            raise Closed(peer=self.peer)
        self._last_heard = time.monotonic()
        self._decoder.feed(self._io.open(data))

    def _encode(self, msg_type_: int, msg: object) -> bytes:
        try:
            return b"" if msg is None else postcard.to_bytes(msg)
        except postcard.PostcardError as e:
            raise Payload(f"cannot encode 0x{msg_type_:04x}: {e}", peer=self.peer) from e

    def _next_frame(self, msg_type_: int, payload: bytes) -> bytes:
        """The next frame's bytes as they go on the wire; numbers it."""
        frame = Frame(self.version(), msg_type_, self._seq, 0, FrameClass.for_type(msg_type_), payload)
        try:
            data = self._io.seal(encode_frame(frame))
        except EnvelopeError as e:
            raise Envelope(str(e), peer=self.peer) from e
        self._seq += 1
        self._last_sent = time.monotonic()
        if self.recorder is not None:
            self.recorder("sent", frame)
        return data

    def _write(self, data: bytes) -> None:
        """Writes all of ``data``, waiting up to the write timeout each time the peer takes
        nothing; a failure leaves the endpoint broken."""
        if self._broken is not None:
            raise self._broken
        sent = 0
        while sent < len(data):
            try:
                sent += gil_held.send(self._sock, data, sent)
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except (OSError, ValueError) as e:
                self._broken = self._io_error("sending", e)
                raise self._broken from e
            if not self._wait_writable():
                self._broken = TimedOut(f"the peer took no bytes for {self._write_timeout:g} s", peer=self.peer)
                raise self._broken

    def _wait_writable(self) -> bool:
        writable = select.poll()
        writable.register(self._sock, select.POLLOUT)
        timeout = -1 if self._write_timeout is None else math.ceil(self._write_timeout * 1000)
        return bool(writable.poll(timeout))

    def _received(self) -> list[Message]:
        """A message for each whole frame the decoder holds."""
        messages = []
        try:
            while (message := self._decoder.decode_next()) is not None:
                message.peer = self.peer
                messages.append(message)
                if self.recorder is not None:
                    self.recorder("received", message)
        except EnvelopeError as e:
            raise Envelope(str(e), peer=self.peer) from e
        if not self._holding.hold(self._decoder.incomplete()):
            raise Envelope(
                f"a frame of {self._decoder.incomplete()} bytes would pass the node's budget for "
                "buffered frames",
                peer=self.peer,
            )
        return messages

    def _first(self, wanted: int, reason: str, deadline: float | None) -> Message:
        """The first message that is not droppable, which must be of type ``wanted``; the
        messages after it wait for the next ``pump``."""
        while True:
            left = _FOREVER if deadline is None else max(deadline - time.monotonic(), 0.0)
            messages = deque(self.pump(left))
            while messages:
                message = messages.popleft()
                if message.class_ == FrameClass.DROPPABLE:
                    continue
                if message.msg_type != wanted:
                    raise Protocol(reason, peer=self.peer)
                self._pending.extend(messages)
                return message
            if deadline is not None and time.monotonic() >= deadline:
                raise TimedOut(f"no answer to the handshake ({reason})", peer=self.peer)

    def _io_error(self, doing: str, e: Exception) -> LinkFError:
        if isinstance(e, ValueError) or getattr(e, "errno", None) in _GONE:
            return Closed(f"while {doing}", peer=self.peer)
        return Io(f"{doing}: {e}", peer=self.peer)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _dial(addr: str | tuple[str, int], timeout: float | None) -> socket.socket:
    target = split_address(addr)
    try:
        sock = socket.create_connection(target, timeout)
    except TimeoutError as e:
        raise TimedOut(f"connecting to {target[0]}:{target[1]}") from e
    except OSError as e:
        raise Io(f"connecting to {target[0]}:{target[1]}: {e}") from e
    sock.settimeout(None)
    return sock
