"""The superfluid wire protocol: the frame envelope, postcard payloads and the catalogs."""

from proto.envelope import (
    HEADER_LEN,
    MAX_FRAME,
    EnvelopeError,
    Frame,
    FrameClass,
    FrameDecoder,
    encode_frame,
)
from proto.postcard import PostcardError

__all__ = [
    "HEADER_LEN",
    "MAX_FRAME",
    "EnvelopeError",
    "Frame",
    "FrameClass",
    "FrameDecoder",
    "PostcardError",
    "encode_frame",
]
