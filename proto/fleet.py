"""The session payload codecs carried inside Link F messages, as the Rust daemon's `fleet`.

`SessionAssignMsg.params` holds a postcard `GenParams`; `AppendContentMsg.blocks` a postcard
`Vec<u32>`, the session's whole context.
"""

from collections.abc import Sequence

from proto.params import GenParams
from proto.postcard import U32, PostcardError, Vec, from_bytes, to_bytes

_TOKENS = Vec[U32]


def encode_params(params: GenParams) -> bytes:
    return to_bytes(params)


def decode_params(data: bytes) -> GenParams:
    """The params in `data`; anything that does not decode (empty, short, foreign) is greedy,
    `GenParams()`, as the Rust node's `unwrap_or_default`."""
    try:
        return from_bytes(GenParams, data)
    except PostcardError:
        return GenParams()


def encode_tokens(tokens: Sequence[int]) -> bytes:
    return to_bytes(tokens, _TOKENS)


def decode_tokens(data: bytes) -> list[int]:
    """The tokens in `data`; malformed bytes raise `PostcardError`."""
    return from_bytes(_TOKENS, data)
