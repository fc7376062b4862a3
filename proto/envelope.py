"""The frame envelope shared by Link W and Link F (linkf-wire.md §1).

A frame is `len: u32` then `len` bytes: a 21-byte little-endian header (proto_version u16,
msg_type u16, seq u64, correlation_id u64, class u8) and the payload.
"""

import enum
from collections.abc import Callable
from dataclasses import dataclass
from struct import Struct
from struct import error as StructError
from typing import Any, Generic, Literal, TypeVar, overload

MAX_FRAME = 16 * 1024 * 1024
DROPPABLE_BIT = 0x8000

#: A frame's first bytes: the length prefix, then the header's fields in order. The one place
#: the layout is spelled; whatever writes or reads a header by hand takes it from here.
FRAME_HEAD = Struct("<IHHQQB")
_PREFIX = Struct("<I")
_FIELDS = Struct("<" + FRAME_HEAD.format.removeprefix(_PREFIX.format))
HEADER_LEN = _FIELDS.size

# Consumed bytes are dropped from the decoder's buffer once there are this many and they are at
# least half of it, which keeps byte-at-a-time feeding linear.
_COMPACT_AT = 1 << 16


class _Skipped(enum.Enum):
    """What `_take_frame` returns for a frame it consumed and dropped."""

    SKIPPED = enum.auto()


_SKIPPED = _Skipped.SKIPPED


class FrameClass(enum.IntEnum):
    REQUIRED = 0
    DROPPABLE = 1

    @classmethod
    def for_type(cls, msg_type: int) -> "FrameClass":
        """The class a `msg_type` must travel in: bit 15 set means droppable."""
        return cls.DROPPABLE if msg_type & DROPPABLE_BIT else cls.REQUIRED


@dataclass
class Frame:
    proto_version: int
    msg_type: int
    seq: int
    correlation_id: int
    class_: FrameClass
    payload: bytes


class EnvelopeError(ValueError):
    """A frame that cannot be written, or a byte stream that breaks the envelope rules."""


class FrameTooLarge(EnvelopeError):
    def __init__(self, length: int, max_len: int = MAX_FRAME) -> None:
        super().__init__(f"frame length {length} exceeds the {max_len} byte cap")
        self.len = length
        self.max = max_len


class ClassRangeMismatch(EnvelopeError):
    def __init__(self, msg_type: int, class_byte: int, expected: FrameClass) -> None:
        super().__init__(
            f"class byte {class_byte} for msg_type 0x{msg_type:04x} disagrees with its range "
            f"(expected {expected.name})"
        )
        self.msg_type = msg_type
        self.class_byte = class_byte
        self.expected = expected


class UnknownRequiredType(EnvelopeError):
    def __init__(self, msg_type: int) -> None:
        super().__init__(f"unknown msg_type 0x{msg_type:04x} in the required range")
        self.msg_type = msg_type


class BadLength(EnvelopeError):
    def __init__(self, length: int, min_len: int = HEADER_LEN) -> None:
        super().__init__(f"frame length {length} is smaller than the {min_len} byte header")
        self.len = length
        self.min = min_len


class Truncated(EnvelopeError):
    def __init__(self, buffered: int) -> None:
        super().__init__(f"stream ended inside a frame ({buffered} bytes buffered)")
        self.buffered = buffered


def encode_frame(frame: Frame) -> bytes:
    """The bytes of `frame`: its length prefix, header and payload."""
    expected = FrameClass.for_type(frame.msg_type)
    if frame.class_ != expected:
        raise ClassRangeMismatch(frame.msg_type, int(frame.class_), expected)
    length = HEADER_LEN + len(frame.payload)
    if length > MAX_FRAME:
        raise FrameTooLarge(length)
    try:
        header = FRAME_HEAD.pack(
            length, frame.proto_version, frame.msg_type, frame.seq, frame.correlation_id, frame.class_
        )
    except StructError as e:
        raise EnvelopeError(f"header field out of range: {e}") from None
    return header + frame.payload


_HTTP_METHODS = (
    b"GET ", b"POST ", b"HEAD ", b"PUT ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"TRACE ", b"PRI "
)


def foreign_protocol(first: bytes | bytearray | memoryview) -> str | None:
    """"HTTP" or "TLS" when the first bytes a peer sent (two or more) open a request of that
    protocol, else None. A peer's first Link F frame (HELLO) or Noise message is short, so its
    length never reads as these bytes do: a `curl` to the port is told apart from a bad frame."""
    first = bytes(first)
    if len(first) < 2:
        return None
    if first[0] == 0x16 and first[1] == 0x03:
        return "TLS"
    if any(first[: len(m)] == m[: len(first)] for m in _HTTP_METHODS):
        return "HTTP"
    return None


#: What a `FrameDecoder` builds each frame as: `Frame` or a subclass of it.
F = TypeVar("F", bound=Frame)


class FrameDecoder(Generic[F]):
    """Splits a byte stream into frames, however it is cut into `feed` calls.

    `is_known(msg_type)` says which types this link speaks: an unknown required type is a
    protocol error, an unknown droppable one is skipped. `max_frame` is the longest frame
    accepted; a reader lowers it while only a small frame is legal (before HELLO).
    `frame_type` is the class each frame is built as, `Frame` or a subclass of it (Link F's
    endpoint builds its messages here, so a frame is built once).
    """

    @overload
    def __init__(self: "FrameDecoder[Frame]", is_known: Callable[[int], bool], max_frame: int = MAX_FRAME) -> None: ...

    @overload
    def __init__(self, is_known: Callable[[int], bool], max_frame: int = MAX_FRAME, *, frame_type: type[F]) -> None: ...

    def __init__(
        self, is_known: Callable[[int], bool], max_frame: int = MAX_FRAME, frame_type: Callable[..., Any] = Frame
    ) -> None:
        self._is_known = is_known
        self.max_frame = max_frame
        self._frame_type: Callable[..., F] = frame_type
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    def decode_next(self) -> F | None:
        """The next whole frame, or None until more bytes arrive."""
        while True:
            frame = self._take_frame()
            if frame is not _SKIPPED:
                return frame

    def buffered(self) -> int:
        """Bytes fed but not yet decoded: the start of a frame still incomplete."""
        return len(self._buf) - self._pos

    def incomplete(self) -> int:
        """Bytes the frame being received takes once whole, its length prefix included, as its
        header announces; what is buffered while the prefix is not in yet; 0 between frames.
        A reader reserves this much, so a frame it has let start can always finish."""
        buffered = self.buffered()
        if buffered < 4:
            return buffered
        (length,) = _PREFIX.unpack_from(self._buf, self._pos)
        return max(buffered, 4 + length)

    def peek(self, n: int) -> bytes:
        """The first `n` bytes not yet decoded (fewer when fewer are buffered)."""
        return bytes(self._buf[self._pos : self._pos + n])

    def finish(self) -> None:
        """Checks that the stream ended between frames."""
        if self.buffered():
            raise Truncated(self.buffered())

    def _take_frame(self) -> F | None | Literal[_Skipped.SKIPPED]:
        """The next frame, None, or `_SKIPPED` for an unknown droppable one, consumed."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < 4:
            return None
        (length,) = _PREFIX.unpack_from(buf, pos)
        if length < HEADER_LEN:
            raise BadLength(length)
        if length > self.max_frame:
            raise FrameTooLarge(length, self.max_frame)
        end = pos + 4 + length
        if len(buf) < end:
            return None
        version, msg_type, seq, correlation_id, class_byte = _FIELDS.unpack_from(buf, pos + 4)
        with memoryview(buf) as view:
            payload = view[pos + 4 + HEADER_LEN : end].tobytes()
        self._consume(end)
        expected = FrameClass.for_type(msg_type)
        if class_byte != expected:
            raise ClassRangeMismatch(msg_type, class_byte, expected)
        if not self._is_known(msg_type):
            if expected == FrameClass.REQUIRED:
                raise UnknownRequiredType(msg_type)
            return _SKIPPED
        return self._frame_type(version, msg_type, seq, correlation_id, expected, payload)

    def _consume(self, end: int) -> None:
        if end == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif end >= _COMPACT_AT and end * 2 >= len(self._buf):
            del self._buf[:end]
            self._pos = 0
        else:
            self._pos = end
