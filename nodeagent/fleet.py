"""The session payload codecs carried inside Link F messages, as the Rust daemon's `fleet`.

`SessionAssignMsg.params` holds a postcard `GenParams`; `AppendContentMsg.blocks` a postcard
`Vec<u32>`, the session's whole context.
"""

from nodeagent.params import GenParams
from proto.postcard import U32, PostcardError, Vec, from_bytes, to_bytes

_TOKENS = Vec[U32]


def encode_params(params):
    return to_bytes(params)


def decode_params(data):
    """The params in `data`; anything that does not decode (empty, short, foreign) is greedy,
    `GenParams()`, as the Rust node's `unwrap_or_default`."""
    try:
        return from_bytes(GenParams, data)
    except PostcardError:
        return GenParams()


def encode_tokens(tokens):
    return to_bytes(tokens, _TOKENS)


def decode_tokens(data):
    """The tokens in `data`; malformed bytes raise `PostcardError`."""
    return from_bytes(_TOKENS, data)
