"""Link F over an encrypted stream: Noise ``NNpsk0`` keyed by the fleet token, so a head and a
node that share the token read each other and nobody else does.

On the wire every Noise message, handshake and transport alike, is a big-endian ``u16`` length
and the message. The head is always the initiator, whichever side dialled.
"""

from __future__ import annotations

import enum
import hashlib
import socket
import struct
import time
from pathlib import Path

from cryptography.exceptions import InvalidTag
from noise.connection import NoiseConnection
from noise.exceptions import NoiseInvalidMessage, NoiseValueError

from proto.envelope import foreign_protocol

from .errors import Closed, Io, Protocol, TimedOut, Unauthorized

PATTERN = b"Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s"
MAX_MESSAGE = 65535
TAG = 16
MAX_PLAINTEXT = MAX_MESSAGE - TAG
_LEN = struct.Struct(">H")
#: ASCII whitespace as Rust's `trim_ascii` sees it (no vertical tab), trimmed off a token.
ASCII_WHITESPACE = b" \t\n\r\x0c"
#: What a node says of a peer that speaks another protocol to its Link F port.
LINKF_ONLY = "this port speaks Link F (a node's Prometheus metrics are on its --metrics-listen port)"
# What a wrong pre-shared key (or a message too short to be Noise) surfaces as, from
# noiseprotocol or from cryptography below it.
_REFUSED = (InvalidTag, NoiseInvalidMessage, NoiseValueError)


class NoiseRole(enum.Enum):
    Initiator = "initiator"
    Responder = "responder"


def read_token(path: str | Path) -> bytes:
    """The fleet token in the file at ``path``: its bytes, ASCII whitespace trimmed (as the
    Rust node reads it). An unreadable file is the ``OSError``."""
    return Path(path).read_bytes().strip(ASCII_WHITESPACE)


def key_from(secret: bytes) -> bytes:
    """The handshake key a shared secret (the token file's bytes) gives."""
    return hashlib.sha256(secret).digest()


class SecureStream:
    """A connected socket after the Noise handshake: ``seal`` encrypts what goes out, ``open``
    decrypts what came in. The caller does the socket I/O, so it chooses how to wait."""

    def __init__(self, sock: socket.socket, noise: NoiseConnection, peer: str | None) -> None:
        self.sock = sock
        self._noise = noise
        self._peer = peer
        self._cipher = bytearray()

    @classmethod
    def handshake(
        cls, sock: socket.socket, key: bytes, role: NoiseRole, timeout: float | None, peer: str | None = None
    ) -> SecureStream:
        """Runs the two-message handshake on ``sock`` within ``timeout`` seconds (None or 0:
        no limit). A peer with another key is ``Unauthorized``; a responder refuses it on the
        first message, before writing anything. ``sock`` is closed when the handshake fails."""
        noise = NoiseConnection.from_name(PATTERN)
        noise.set_psks(psk=key)
        if role is NoiseRole.Initiator:
            noise.set_as_initiator()
        else:
            noise.set_as_responder()
        noise.start_handshake()
        deadline = time.monotonic() + timeout if timeout else None
        previous = sock.gettimeout()
        try:
            if role is NoiseRole.Initiator:
                _write_message(sock, noise.write_message(), peer)
                _read_handshake(noise, _read_message(sock, deadline, peer), peer)
            else:
                _read_handshake(noise, _read_message(sock, deadline, peer, first=True), peer)
                _write_message(sock, noise.write_message(), peer)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(previous)
        return cls(sock, noise, peer)

    def seal(self, data: bytes) -> bytes:
        """``data`` as it goes on the wire: Noise messages of at most ``MAX_PLAINTEXT`` bytes of
        plaintext each, every one behind its length."""
        wire = bytearray()
        for at in range(0, len(data), MAX_PLAINTEXT):
            message = self._noise.encrypt(bytes(data[at : at + MAX_PLAINTEXT]))
            wire += _LEN.pack(len(message))
            wire += message
        return bytes(wire)

    def open(self, data: bytes) -> bytes:
        """The plaintext of every Noise message that ``data`` completes (maybe none); the rest
        of a message cut across reads waits for the next call."""
        self._cipher += data
        return self._decrypt_complete()

    def _decrypt_complete(self) -> bytes:
        plain = bytearray()
        at = 0
        while len(self._cipher) - at >= 2:
            (n,) = _LEN.unpack_from(self._cipher, at)
            if len(self._cipher) - at - 2 < n:
                break
            try:
                plain += self._noise.decrypt(bytes(self._cipher[at + 2 : at + 2 + n]))
            except _REFUSED as e:
                raise Io("a Noise message that is not ours", peer=self._peer) from e
            at += 2 + n
        del self._cipher[:at]
        return bytes(plain)


def _read_handshake(noise: NoiseConnection, message: bytes, peer: str | None) -> None:
    try:
        noise.read_message(message)
    except _REFUSED as e:
        raise Unauthorized("its fleet token differs", peer=peer) from e


def _write_message(sock: socket.socket, message: bytes, peer: str | None) -> None:
    try:
        sock.sendall(_LEN.pack(len(message)) + bytes(message))
    except OSError as e:
        raise Io(f"writing the Noise handshake: {e}", peer=peer) from e


def _read_message(sock: socket.socket, deadline: float | None, peer: str | None, first: bool = False) -> bytes:
    """One length-prefixed Noise message; `first`: the peer's first bytes, which are checked
    for another protocol (a browser, `curl`, a TLS client) before a length is believed."""
    prefix = _read_exact(sock, 2, deadline, peer)
    foreign = foreign_protocol(prefix) if first else None
    if foreign is not None:
        raise Protocol(f"the peer speaks {foreign}; {LINKF_ONLY}", peer=peer)
    (n,) = _LEN.unpack(prefix)
    return _read_exact(sock, n, deadline, peer)


def _read_exact(sock: socket.socket, n: int, deadline: float | None, peer: str | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimedOut("the Noise handshake did not finish in time", peer=peer)
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError as e:
            raise TimedOut("the Noise handshake did not finish in time", peer=peer) from e
        except OSError as e:
            raise Io(f"reading the Noise handshake: {e}", peer=peer) from e
        if not chunk:
            raise Closed("during the Noise handshake", peer=peer)
        buf += chunk
    return bytes(buf)
