"""Finish reasons of the engine ABI (`superfluid_abi::finish`), carried in a Finish event.

The node agent adds its own three at the top of the u32 range.
"""

NONE = 0
EOS = 1
LENGTH = 2
GRAMMAR = 3
CANCELLED = 4
ERROR = 5

#: The wall budget of a generation ran out (the head reads it as a normal, expired result).
EXPIRED = 2**32 - 1
#: The node cannot stage the generation: a context past its window, a constraint it lacks.
REFUSED = 2**32 - 2
#: Unknown session, superseded epoch, replayed command, or a generation already running here.
DECLINED = 2**32 - 3

#: Each code's name, as metrics label it and logs and the conformance kit print it.
NAMES = {
    NONE: "none",
    EOS: "eos",
    LENGTH: "length",
    GRAMMAR: "grammar",
    CANCELLED: "cancelled",
    ERROR: "error",
    EXPIRED: "expired",
    REFUSED: "refused",
    DECLINED: "declined",
}


def name(code: int) -> str:
    """`code`'s name; `code_N` for one no engine or node defines."""
    return NAMES.get(code, f"code_{code}")
