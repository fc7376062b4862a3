"""Postcard, serde's compact binary format, driven by dataclass annotations.

A struct is a dataclass whose annotations are wire types (`U64`, `Vec[U32]`, another struct,
an `IntEnum` of unit variants, a `data_enum`); its fields are written in declaration order with
nothing between them. Values are plain Python: int, float, bool, str, bytes, list, tuple, None.

Each struct's encoder and decoder are compiled once, on first use, into Python functions with
the scalar fields inlined; containers call their element type's own `encode` / `decode`.
Decoding takes `(data, offset)` and returns `(value, next_offset)`; every failure is a
`PostcardError` naming the field path and the byte offset.

A varint is read by one piece of generated code (`_varint_src`), inlined wherever one is read:
a struct's field, a varint list's element, a varint on its own. To a type checker the wire types
are the Python types of their values (`U64` is `int`, `Vec[Str]` is `list[str]`), so a message's
fields are typed as what they hold.
"""

import bisect
import dataclasses
import enum
import functools
import operator
import sys
import types
import typing
from array import array
from collections.abc import Callable, Iterable, Sequence
from struct import Struct
from struct import error as StructError
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, dataclass_transform

__all__ = [
    "PostcardError",
    "U8",
    "Bool",
    "U16",
    "U32",
    "U64",
    "F32",
    "Str",
    "Bytes",
    "Array32",
    "Vec",
    "Option",
    "Tuple",
    "Unit",
    "struct",
    "data_enum",
    "wire_type",
    "to_bytes",
    "from_bytes",
    "to_plain",
]

_C = TypeVar("_C", bound=type)
#: Names a value for generated code: puts it in the code's namespace, returns the name.
_Ref = Callable[[object], str]


class PostcardError(ValueError):
    """A value that cannot be written, or bytes that are not a valid encoding.

    `path` grows from the innermost field outwards (`.lease.duration_ms`, `[3]`); the top level
    prefixes the type name.
    """

    def __init__(self, reason: str, offset: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.offset = offset
        self.path = ""

    def within(self, segment: str) -> "PostcardError":
        self.path = segment + self.path
        return self

    def __str__(self) -> str:
        where = "" if self.offset is None else f" at offset {self.offset}"
        head = f"{self.path}: " if self.path else ""
        return f"{head}{self.reason}{where}"


def _eof(offset: int) -> PostcardError:
    return PostcardError("unexpected end of input", offset)


def _as_error(exc: BaseException, data: bytes | None = None) -> PostcardError:
    """The `PostcardError` for `exc`, raised while writing a value or reading one from `data`.

    Reading validates every length against the input first, so an index past the end always
    means the input ended: at `len(data)`.
    """
    if isinstance(exc, PostcardError):
        return exc
    if data is not None and isinstance(exc, (IndexError, StructError)):
        return _eof(len(data))
    return PostcardError(f"cannot encode: {type(exc).__name__}: {exc}")


_ENCODE_ERRORS = (TypeError, ValueError, AttributeError, OverflowError, IndexError, KeyError, StructError)
_DECODE_ERRORS = (PostcardError, IndexError, StructError)


# Generated code


def _function(ns: dict[str, Any], signature: str, body: list[str]) -> Callable[..., Any]:
    """The function `def {signature}:` with `body`, compiled in namespace `ns`."""
    name = signature.partition("(")[0]
    source = "\n".join([f"def {signature}:", *_indent(body, 1)])
    exec(compile(source, f"<postcard {name}>", "exec"), ns)
    return ns.pop(name)


def _indent(lines: Iterable[str], levels: int) -> list[str]:
    pad = "    " * levels
    return [pad + line for line in lines]


def _namer(ns: dict[str, Any]) -> _Ref:
    """A `ref` for generated code in `ns`."""

    def ref(obj: object) -> str:
        name = f"_r{len(ns)}"
        ns[name] = obj
        return name

    return ref


def _field_at(exc: BaseException, starts: Sequence[int]) -> int:
    """The index of the field whose lines (starting at `starts`) `exc` came through."""
    tb: TracebackType | None = exc.__traceback__
    return bisect.bisect_right(starts, tb.tb_lineno if tb else 0) - 1


# Varints

_SMALL = 1 << 14
_VARINT = [bytes([v]) if v < 0x80 else bytes([v & 0x7F | 0x80, v >> 7]) for v in range(_SMALL)]
# The first two bytes of every longer varint, by its low 14 bits.
_LOW14 = [bytes([v & 0x7F | 0x80, v >> 7 | 0x80]) for v in range(_SMALL)]


def _write_varint(v: Any, bits: int) -> bytes:
    """The LEB128 bytes of `v`, which must be an int in the unsigned `bits`-bit range."""
    try:
        v = operator.index(v)
    except TypeError:
        raise PostcardError(f"expected an int for u{bits}, got {type(v).__name__}") from None
    if not 0 <= v < 1 << bits:
        raise PostcardError(f"{v} is out of the u{bits} range")
    out = b""
    while v >= _SMALL:
        out += _LOW14[v & 0x3FFF]
        v >>= 14
    return out + _VARINT[v]


def _len_prefix(n: int) -> bytes:
    """The length prefix of `n` bytes or elements: a `usize`, written as a u64 varint."""
    return _VARINT[n] if n < _SMALL else _write_varint(n, 64)


def _varint_src(bits: int, to: str) -> list[str]:
    """Source lines reading the `bits`-bit varint at offset `p` of bytes `d` into local `to` and
    moving `p` past it: at most ceil(bits/7) bytes, the last one holding only the bits that
    remain. Reading past the end is left to the caller, as an `IndexError`.

    It is unrolled, one nested step a byte, which costs half what a loop does in Python. Each
    byte is added whole, continuation bit and all, and the sum of the continuation bits seen is
    taken off once, at the last byte: one- to three-byte varints, nearly all of them, cost an
    index, a compare and an add a byte.
    """
    size = -(-bits // 7)
    last_max = (1 << (bits - 7 * (size - 1))) - 1
    src = [f"{to} = d[p]", f"if {to} < 0x80:", "    p += 1", "else:"]
    depth = 1
    for i in range(1, size):
        continuations = sum(0x80 << 7 * j for j in range(i))
        step = [f"b = d[p + {i}]", "if b < 0x80:"]
        if i == size - 1:
            step.append(f"    if b > {last_max}: raise PostcardError('varint above the u{bits} range', p)")
        step += [f"    {to} += (b << {7 * i}) - {continuations}", f"    p += {i + 1}", "else:"]
        if i < size - 1:
            step.append(f"    {to} += b << {7 * i}")
        src += _indent(step, depth)
        depth += 1
    src += _indent([f"raise PostcardError('varint longer than {size} bytes', p)"], depth)
    return src


def _read_span(d: bytes, p: int) -> tuple[int, int]:
    """A length prefix at `p` and the offsets of that many bytes after it."""
    n, q = _read_len(d, p)
    if n > len(d) - q:
        raise PostcardError(f"length {n} runs past the end ({len(d) - q} bytes left)", p)
    return q, q + n


def _check_bool(b: int, p: int) -> bool:
    if b > 1:
        raise PostcardError(f"invalid bool byte 0x{b:02x}", p)
    return b == 1


def _write_bool(v: Any) -> bytes:
    if v is True:
        return b"\x01"
    if v is False:
        return b"\x00"
    raise PostcardError(f"expected a bool, got {type(v).__name__}")


_F32 = Struct("<f")


def _code_ns() -> dict[str, Any]:
    """A namespace for generated code, holding what `enc_src` / `dec_src` lines call by name."""
    return {
        "_VARINT": _VARINT,
        "_LOW14": _LOW14,
        "_F32": _F32,
        "_check_bool": _check_bool,
        "_write_bool": _write_bool,
        "_as_error": _as_error,
        "_eof": _eof,
        "_field_at": _field_at,
        "_ENCODE_ERRORS": _ENCODE_ERRORS,
        "_DECODE_ERRORS": _DECODE_ERRORS,
        "PostcardError": PostcardError,
    }


# Wire types


class WireType:
    """How one Rust type is written; `name` spells it as Rust does, for messages.

    `enc_src` / `dec_src` give the source lines a compiled struct inlines for a field of this
    type: writing local `x` to bytearray `out`, or reading local `to` from bytes `d` at offset `p`
    and advancing `p`. `ref(obj)` names `obj` in the compiled code's namespace. The default calls
    the type's own `encode` / `decode`.
    """

    name = "?"

    def zero(self) -> Any:
        raise NotImplementedError

    def encode(self, v: Any, out: bytearray) -> None:
        raise NotImplementedError

    def decode(self, d: bytes, p: int) -> tuple[Any, int]:
        raise NotImplementedError

    def value_of(self, d: bytes) -> Any:
        """The value at the start of `d`."""
        return self.decode(d, 0)[0]

    def zero_sized(self) -> bool:
        """Whether every value of this type is written as no bytes at all."""
        return False

    def enc_src(self, ref: _Ref) -> list[str]:
        return [f"{ref(self.encode)}(x, out)"]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        return [f"{to}, p = {ref(self.decode)}(d, p)"]

    def __repr__(self) -> str:
        return self.name


class _Varint(WireType):
    """An unsigned int of `bits` bits, as a LEB128 varint. Its own `encode` and `decode` are
    compiled from the source it inlines into a struct."""

    def __init__(self, bits: int) -> None:
        self.name = f"u{bits}"
        self.bits = bits
        ns = _code_ns()
        ref = _namer(ns)
        self.encode = _function(ns, "encode(x, out)", self.enc_src(ref))  # type: ignore[method-assign]
        read = ["try:", *_indent(self.dec_src(ref, "v"), 1), "except IndexError:", "    raise _eof(len(d)) from None"]
        self.decode = _function(ns, "decode(d, p)", [*read, "return v, p"])  # type: ignore[method-assign]

    def zero(self) -> int:
        return 0

    def write(self, v: Any) -> bytes:
        return _write_varint(v, self.bits)

    def enc_src(self, ref: _Ref) -> list[str]:
        # Up to four bytes without a call, as `write` would: a node's counts, sizes and clocks
        # (bytes of memory aside) are nearly all under 2^28, and the call costs more than the
        # writing. Only an int takes the middle branch; `write` names what else is wrong.
        top = min(1 << 28, 1 << self.bits)
        return [
            f"out += _VARINT[x] if 0 <= x < {_SMALL} else (_LOW14[x & 0x3FFF] + _VARINT[x >> 14])"
            f" if type(x) is int and {_SMALL} <= x < {top} else {ref(self.write)}(x)"
        ]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        return _varint_src(self.bits, to)


class _U8(WireType):
    name = "u8"

    def zero(self) -> int:
        return 0

    def encode(self, v: Any, out: bytearray) -> None:
        out.append(v)

    def decode(self, d: bytes, p: int) -> tuple[int, int]:
        if p >= len(d):
            raise _eof(p)
        return d[p], p + 1

    def enc_src(self, ref: _Ref) -> list[str]:
        return ["out.append(x)"]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        return [f"{to} = d[p]", "p += 1"]


class _Bool(WireType):
    name = "bool"

    def zero(self) -> bool:
        return False

    def encode(self, v: Any, out: bytearray) -> None:
        out += _write_bool(v)

    def decode(self, d: bytes, p: int) -> tuple[bool, int]:
        if p >= len(d):
            raise _eof(p)
        return _check_bool(d[p], p), p + 1

    def enc_src(self, ref: _Ref) -> list[str]:
        return ["out += _write_bool(x)"]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        return [f"{to} = _check_bool(d[p], p)", "p += 1"]


class _F32Type(WireType):
    name = "f32"

    def zero(self) -> float:
        return 0.0

    def encode(self, v: Any, out: bytearray) -> None:
        out += _F32.pack(v)

    def decode(self, d: bytes, p: int) -> tuple[float, int]:
        if len(d) - p < 4:
            raise _eof(len(d))
        return _F32.unpack_from(d, p)[0], p + 4

    def enc_src(self, ref: _Ref) -> list[str]:
        return ["out += _F32.pack(x)"]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        return [f"{to} = _F32.unpack_from(d, p)[0]", "p += 4"]


class _Str(WireType):
    name = "String"

    def zero(self) -> str:
        return ""

    def encode(self, v: Any, out: bytearray) -> None:
        if not isinstance(v, str):
            raise PostcardError(f"expected a str, got {type(v).__name__}")
        b = v.encode()
        out += _len_prefix(len(b))
        out += b

    def decode(self, d: bytes, p: int) -> tuple[str, int]:
        q, end = _read_span(d, p)
        try:
            return d[q:end].decode(), end
        except UnicodeDecodeError as e:
            raise PostcardError(f"invalid UTF-8 ({e.reason})", q + e.start) from None


class _Bytes(WireType):
    name = "Vec<u8>"

    def zero(self) -> bytes:
        return b""

    def encode(self, v: Any, out: bytearray) -> None:
        out += _len_prefix(len(v))
        out += v

    def decode(self, d: bytes, p: int) -> tuple[bytes, int]:
        q, end = _read_span(d, p)
        return d[q:end], end


class _Array32(WireType):
    name = "[u8; 32]"

    def zero(self) -> bytes:
        return bytes(32)

    def encode(self, v: Any, out: bytearray) -> None:
        if len(v) != 32:
            raise PostcardError(f"expected 32 bytes, got {len(v)}")
        out += v

    def decode(self, d: bytes, p: int) -> tuple[bytes, int]:
        if len(d) - p < 32:
            raise _eof(len(d))
        return d[p : p + 32], p + 32


class _Unit(WireType):
    """Rust's `()`: no bytes; the Python value is None."""

    name = "()"

    def zero(self) -> None:
        return None

    def encode(self, v: Any, out: bytearray) -> None:
        if v is not None:
            raise PostcardError(f"expected None for (), got {type(v).__name__}")

    def decode(self, d: bytes, p: int) -> tuple[None, int]:
        return None, p

    def zero_sized(self) -> bool:
        return True


_U16 = _Varint(16)
_U32 = _Varint(32)
_U64 = _Varint(64)
#: A length prefix at offset `p` of `d` (a `usize`, written as a u64 varint), and the offset after it.
_read_len: Callable[[bytes, int], tuple[int, int]] = _U64.decode


class _VecType(WireType):
    def __init__(self, elem: WireType) -> None:
        self.elem = elem
        self.name = f"Vec<{elem.name}>"

    def zero(self) -> list[Any]:
        return []

    def encode(self, v: Any, out: bytearray) -> None:
        out += _len_prefix(len(v))
        put = self.elem.encode
        for i, x in enumerate(v):
            try:
                put(x, out)
            except _ENCODE_ERRORS as e:
                raise _as_error(e).within(f"[{i}]") from None

    def decode(self, d: bytes, p: int) -> tuple[list[Any], int]:
        n, p = _read_len(d, p)
        if n > len(d) - p:
            if self.elem.zero_sized():
                return self._zero_sized_run(d, p, n)
            raise PostcardError(f"{n} elements cannot fit in the {len(d) - p} bytes left", p)
        get = self.elem.decode
        out = []
        for i in range(n):
            try:
                x, p = get(d, p)
            except PostcardError as e:
                raise e.within(f"[{i}]") from None
            out.append(x)
        return out, p

    def _zero_sized_run(self, d: bytes, p: int, n: int) -> tuple[list[Any], int]:
        """`n` elements that take no bytes, as upstream postcard reads them: however many the
        length says, with no input behind them. (No message of the catalog has such a list, so
        no peer can make the node build one.)"""
        get = self.elem.decode
        try:
            return [get(d, p)[0] for _ in range(n)], p
        except MemoryError:
            raise PostcardError(f"{n} elements of {self.elem.name} do not fit in memory", p) from None


def _array_code(bits: int) -> str:
    """The `array` type code of unsigned ints of `bits` bits."""
    return next(code for code in "BHILQ" if array(code).itemsize * 8 == bits)


#: The varint of every value seen in a token list that is not written all at once (a short
#: list, such as a decode step's one-token event, a Vec<u64>, or a list with a zero), by value:
#: the first 2**14 written at import, the rest as they come, up to this cap (2 MiB of slots at
#: the most, a vocabulary's worth). A list, not a dict: on a streaming node the dict's lookups,
#: their entries out of cache, were a large share of its time (long lists now skip the table:
#: `_varints_at_once`).
_VARINT_CACHE_MAX = 1 << 18
_VARINTS: list[bytes | None] = list(_VARINT)
#: A value's varint from the table: a value not in it yet is a None there, which `join`
#: refuses, or past its end.
_table_lookup = typing.cast(Callable[[int], bytes], _VARINTS.__getitem__)


def _table_varint(x: int, write: Callable[[int], bytes]) -> bytes:
    """The varint of `x` from the table, written into it at first sight."""
    if x >= _VARINT_CACHE_MAX:
        return write(x)
    if x >= len(_VARINTS):  # two threads may both grow it: the longer list is as good
        _VARINTS.extend([None] * (x + 1 - len(_VARINTS)))
    b = _VARINTS[x]
    if b is None:
        b = _VARINTS[x] = write(x)
    return b


#: Varint lists at least this long are written by `_varints_at_once`, a couple dozen steps over
#: the whole list as one Python int, which beats the table's join once its entries are out of
#: cache, as on a streaming node. (numpy lets go of the GIL at each step of an array this long,
#: and on a node with many threads each step then waits its turn.)
_AT_ONCE_MIN = 128
#: Values worked out together at most: the masks are kept for each run length.
_AT_ONCE_RUN = 1024


class _LaneMasks:
    """Masks over `n` lanes of 8 bytes, one lane a value, each as one int: `groups[k]` keeps
    group k (7 bits) in byte k, k < 5 (a value below 2**32 has five); `low7` (0x7F in bytes
    0-4), added to the groups, sets bit 7 of each nonzero one, which `bit7` keeps; `continued`
    is bit 7 of bytes 0-3, where a continuation bit may go; `first` bit 7 of byte 0; and
    `beyond[bits]` the bits above a `bits`-bit value."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.groups = [self._lanes(0x7F << 8 * k) for k in range(5)]
        self.low7 = self._lanes(0x7F7F7F7F7F)
        self.bit7 = self._lanes(0x8080808080)
        self.continued = self._lanes(0x80808080)
        self.first = self._lanes(0x80)
        self.beyond = {bits: self._lanes((1 << 64) - (1 << bits)) for bits in (16, 32)}

    def _lanes(self, lane: int) -> int:
        return int.from_bytes(lane.to_bytes(8, "little") * self.n, "little")


@functools.lru_cache(maxsize=8)
def _lane_masks(n: int) -> _LaneMasks:
    return _LaneMasks(n)


def _varints_at_once(values: Sequence[int], bits: int) -> bytearray | None:
    """The LEB128 bytes of `values` (`bits` is 16 or 32), worked out `_AT_ONCE_RUN` at a time;
    None when a value is zero, or is not an int of the range: the caller's other way says which."""
    try:
        lanes = array("Q", values)
    except (TypeError, ValueError, OverflowError):
        return None
    if sys.byteorder == "big":
        lanes.byteswap()
    out = bytearray()
    for i in range(0, len(lanes), _AT_ONCE_RUN):
        run = _run_varints(lanes[i : i + _AT_ONCE_RUN], bits)
        if run is None:
            return None
        out += run
    return out


def _run_varints(lanes: array, bits: int) -> bytes | None:
    """The varints of little-endian u64 `lanes` as one int, a lane of 8 bytes a value: each
    7-bit group k moves up k bits to byte k, byte k gets its continuation bit when a byte above
    it in the lane is nonzero, and every zero byte is dropped. Only a zero value's varint is a
    zero byte (a longer varint ends in its nonzero top group), so None when a value is zero (or
    beyond `bits`). No shift carries a bit into the next lane, whose top 3 bytes stay empty."""
    m = _lane_masks(len(lanes))
    x = int.from_bytes(lanes, "little")
    if x & m.beyond[bits]:
        return None
    g = m.groups
    spread = x & g[0] | (x << 1) & g[1] | (x << 2) & g[2] | (x << 3) & g[3] | (x << 4) & g[4]
    nonzero = (spread + m.low7) & m.bit7
    here_or_above = nonzero | nonzero >> 8
    here_or_above |= here_or_above >> 16  # bytes k to k + 3
    above = here_or_above >> 8  # bytes k + 1 to k + 4
    if (here_or_above | above) & m.first != m.first:
        return None
    return (spread | above & m.continued).to_bytes(8 * len(lanes), "little").translate(None, b"\0")


class _VarintVec(_VecType):
    """`Vec<u16|u32|u64>`, token lists above all.

    Writing works out a long list of u16 or u32 values all at once (`_varints_at_once`), and
    otherwise checks the whole list with `array` and joins cached varints in C; reading inlines
    the element's varint in its loop. Any sequence of ints is written, bytes included.
    """

    def __init__(self, elem: _Varint) -> None:
        super().__init__(elem)
        self.varint = elem
        self.code = _array_code(elem.bits)
        loop = ["for i in range(len(out)):", *_indent(_varint_src(elem.bits, "x"), 1), "    out[i] = x"]
        self.read_run = _function(
            _code_ns(),
            "read_run(d, p, out)",
            [
                "i = 0",
                "try:",
                *_indent(loop, 1),
                "except IndexError:",
                "    raise _eof(len(d)).within(f'[{i}]') from None",
                "except PostcardError as e:",
                "    raise e.within(f'[{i}]') from None",
                "return p",
            ],
        )

    def encode(self, v: Any, out: bytearray) -> None:
        out += _len_prefix(len(v))
        if len(v) >= _AT_ONCE_MIN and self.varint.bits <= 32:
            at_once = _varints_at_once(v, self.varint.bits)
            if at_once is not None:
                out += at_once
                return
        try:
            array(self.code, v)
        except (TypeError, ValueError, OverflowError):
            self._check_elements(v)
        try:
            out += b"".join(map(_table_lookup, v))
        except (TypeError, IndexError):
            write = self.varint.write
            out += b"".join([_table_varint(x, write) for x in v])

    def _check_elements(self, v: Iterable[Any]) -> None:
        """Raises for the first element out of range, where `array` took `v` as a whole amiss."""
        for i, x in enumerate(v):
            try:
                self.varint.write(x)
            except PostcardError as e:
                raise e.within(f"[{i}]") from None

    def decode(self, d: bytes, p: int) -> tuple[list[int], int]:
        n, p = _read_len(d, p)
        if n > len(d) - p:
            raise PostcardError(f"{n} elements cannot fit in the {len(d) - p} bytes left", p)
        run = d[p : p + n]
        if run.isascii():
            return list(run), p + n
        out = [0] * n
        return out, self.read_run(d, p, out)


class _OptionType(WireType):
    def __init__(self, inner: WireType) -> None:
        self.inner = inner
        self.name = f"Option<{inner.name}>"

    def zero(self) -> None:
        return None

    def encode(self, v: Any, out: bytearray) -> None:
        if v is None:
            out.append(0)
        else:
            out.append(1)
            self.inner.encode(v, out)

    def decode(self, d: bytes, p: int) -> tuple[Any, int]:
        if p >= len(d):
            raise _eof(p)
        tag = d[p]
        if tag == 0:
            return None, p + 1
        if tag != 1:
            raise PostcardError(f"invalid Option tag 0x{tag:02x}", p)
        return self.inner.decode(d, p + 1)


class _TupleType(WireType):
    def __init__(self, elems: tuple[WireType, ...]) -> None:
        self.elems = elems
        self.name = "(" + ", ".join(t.name for t in elems) + ")"

    def zero(self) -> tuple[Any, ...]:
        return tuple(t.zero() for t in self.elems)

    def zero_sized(self) -> bool:
        return all(t.zero_sized() for t in self.elems)

    def encode(self, v: Any, out: bytearray) -> None:
        if len(v) != len(self.elems):
            raise PostcardError(f"expected a {len(self.elems)}-tuple, got {len(v)} items")
        for i, (t, x) in enumerate(zip(self.elems, v, strict=True)):
            try:
                t.encode(x, out)
            except _ENCODE_ERRORS as e:
                raise _as_error(e).within(f".{i}") from None

    def decode(self, d: bytes, p: int) -> tuple[tuple[Any, ...], int]:
        out = []
        for i, t in enumerate(self.elems):
            try:
                x, p = t.decode(d, p)
            except PostcardError as e:
                raise e.within(f".{i}") from None
            out.append(x)
        return tuple(out), p


class _Generic:
    """`Vec[T]`, `Option[T]`, `Tuple[T1, T2]`: one cached wire type per argument."""

    def __init__(self, make: Callable[..., WireType]) -> None:
        self.make = make
        self.cache: dict[tuple[Any, ...], WireType] = {}

    def __getitem__(self, args: Any) -> WireType:
        key = args if isinstance(args, tuple) else (args,)
        if key not in self.cache:
            self.cache[key] = self.make(*map(wire_type, key))
        return self.cache[key]


def _vec_of(t: WireType) -> WireType:
    return _VarintVec(t) if isinstance(t, _Varint) else _VecType(t)


class _UnitEnum(WireType):
    """An `IntEnum` of unit variants: the variant index as a varint."""

    def __init__(self, cls: type[enum.IntEnum]) -> None:
        self.cls = cls
        self.name = cls.__name__
        self.members = tuple(cls)
        if [int(m) for m in self.members] != list(range(len(self.members))):
            raise TypeError(f"{cls.__name__}: values must be 0, 1, 2, ... in declaration order")

    def zero(self) -> enum.IntEnum:
        return self.members[0]

    def encode(self, v: Any, out: bytearray) -> None:
        if not isinstance(v, self.cls):
            raise PostcardError(f"expected a {self.name}, got {type(v).__name__}")
        out += _VARINT[v]

    def decode(self, d: bytes, p: int) -> tuple[enum.IntEnum, int]:
        i, q = _U32.decode(d, p)
        if i >= len(self.members):
            raise PostcardError(f"unknown {self.name} variant {i}", p)
        return self.members[i], q


class _DataEnum(WireType):
    """A Rust enum with data: the variant index as a varint, then the variant's fields.

    Each variant is a dataclass; a newtype variant is one with a single field, which postcard
    writes exactly as the wrapped value. An error's path goes on with the variant's fields.
    """

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name = cls.__name__
        self.variants: tuple[type, ...] = cls._variants  # type: ignore[attr-defined]
        self.structs = [_struct_of(v) for v in self.variants]
        self.writers: dict[type, tuple[bytes, Callable[[Any, bytearray], None]]] | None = None

    def zero(self) -> Any:
        return self.variants[0]()

    def _writers(self) -> dict[type, tuple[bytes, Callable[[Any, bytearray], None]]]:
        """Each variant's index bytes and field encoder, by its class (made on first use, as
        the variants compile then)."""
        if self.writers is None:
            self.writers = {
                v: (_VARINT[i], s.compiled_encode())
                for i, (v, s) in enumerate(zip(self.variants, self.structs, strict=True))
            }
        return self.writers

    def encode(self, v: Any, out: bytearray) -> None:
        found = self._writers().get(type(v))
        if found is None:
            raise PostcardError(f"expected a {self.name} variant, got {type(v).__name__}")
        out += found[0]
        found[1](v, out)

    def decode(self, d: bytes, p: int) -> tuple[Any, int]:
        i, q = _U32.decode(d, p)
        if i >= len(self.structs):
            raise PostcardError(f"unknown {self.name} variant {i}", p)
        return self.structs[i].decode(d, q)

    def enc_src(self, ref: _Ref) -> list[str]:
        return [
            f"w = {ref(self._writers())}.get(type(x))",
            "if w is None:",
            f"    {ref(self.encode)}(x, out)",
            "else:",
            "    out += w[0]",
            "    w[1](x, out)",
        ]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        readers = tuple(s.compiled_decode() for s in self.structs)
        return [
            f"if d[p] < {len(readers)}:",
            f"    {to}, p = {ref(readers)}[d[p]](d, p + 1)",
            "else:",
            f"    {to}, p = {ref(self.decode)}(d, p)",
        ]


# Structs


class _StructType(WireType):
    """A dataclass, compiled on first use into an encoder and a decoder with inlined scalars."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name = cls.__name__
        self.compiled = False

    def zero(self) -> Any:
        return self.cls()

    def zero_sized(self) -> bool:
        return all(t.zero_sized() for _, t in self._fields())

    def encode(self, v: Any, out: bytearray) -> None:
        self._compile()
        self.encode(v, out)

    def decode(self, d: bytes, p: int) -> tuple[Any, int]:
        self._compile()
        return self.decode(d, p)

    def value_of(self, d: bytes) -> Any:
        self._compile()
        return self.value_of(d)

    def enc_src(self, ref: _Ref) -> list[str]:
        return [f"{ref(self.compiled_encode())}(x, out)"]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        return [f"{to}, p = {ref(self.compiled_decode())}(d, p)"]

    def compiled_encode(self) -> Callable[[Any, bytearray], None]:
        self._compile()
        return self.encode

    def compiled_decode(self) -> Callable[[bytes, int], tuple[Any, int]]:
        self._compile()
        return self.decode

    def _fields(self) -> list[tuple[str, WireType]]:
        return [(f.name, wire_type(f.type)) for f in dataclasses.fields(self.cls)]

    def _compile(self) -> None:
        """Replaces `encode`, `decode` and `value_of` on this instance with compiled functions.

        Threads racing here each compile and set the same functions; `compiled` is set last, so
        none can find it set before the functions are.
        """
        if self.compiled:
            return
        ns = _code_ns()
        ns.update(NEW=self.cls, _new=object.__new__)
        source = _struct_source(self._fields(), _namer(ns), _assigns_only(self.cls))
        exec(compile(source, f"<postcard {self.name}>", "exec"), ns)
        self.encode, self.decode, self.value_of = ns["encode"], ns["decode"], ns["value_of"]  # type: ignore[method-assign]
        self.compiled = True


def _struct_source(fields: list[tuple[str, WireType]], ref: _Ref, assign: bool) -> str:
    """The source of `encode(v, out)`, `decode(d, p)` and `value_of(d)` for a struct of
    `fields`; with `assign`, decoding sets the fields on a bare instance rather than calling the
    class. `value_of` is `decode` at offset 0 returning the value alone, the top level's
    shortcut.

    An error names its field from the line it came from (`_field_at`), so that the fast path
    pays nothing for tracking where it is.
    """
    if not fields:
        empty = ["def encode(v, out):", "    pass", "def decode(d, p):", "    return NEW(), p"]
        return "\n".join(empty + ["def value_of(d):", "    return NEW()"])
    names = ref(tuple("." + name for name, _ in fields))
    enc, enc_starts = ["def encode(v, out):", "    try:"], []
    body: list[str] = []
    body_starts = []
    for i, (name, t) in enumerate(fields):
        enc_starts.append(len(enc) + 1)
        enc += [f"        x = v.{name}", *_indent(t.enc_src(ref), 2)]
        body_starts.append(len(body))
        body += _indent(t.dec_src(ref, f"x{i}"), 2)
    enc += [
        "    except _ENCODE_ERRORS as e:",
        f"        raise _as_error(e).within({names}[_field_at(e, {ref(enc_starts)})]) from None",
    ]
    if assign:
        build = ["    o = _new(NEW)"] + [f"    o.{name} = x{i}" for i, (name, _) in enumerate(fields)]
    else:
        build = ["    o = NEW(" + ", ".join(f"x{i}" for i in range(len(fields))) + ")"]
    lines = enc
    decode_head = ["def decode(d, p):", "    try:"]
    value_of_head = ["def value_of(d):", "    p = 0", "    try:"]
    for head, result in [(decode_head, "o, p"), (value_of_head, "o")]:
        starts = [len(lines) + len(head) + 1 + line for line in body_starts]
        lines = lines + head + body
        lines += [
            "    except _DECODE_ERRORS as e:",
            f"        raise _as_error(e, d).within({names}[_field_at(e, {ref(starts)})]) from None",
        ]
        lines += build + [f"    return {result}"]
    return "\n".join(lines)


def _assigns_only(cls: type) -> bool:
    """Whether `cls(*fields)` does nothing but set its fields, which a decoder can do itself
    faster: so for a `struct` with the dataclass `__init__` and no `__post_init__`."""
    return bool(cls.__dict__.get("_assigns_only", False))


_STRUCTS: dict[type, _StructType] = {}
_TYPES: dict[Any, WireType] = {}


def _struct_of(cls: type) -> _StructType:
    """The fields of dataclass `cls` as a struct (for a variant: without its index)."""
    t = _STRUCTS.get(cls)
    if t is None:
        t = _STRUCTS[cls] = _StructType(cls)
    return t


def wire_type(annotation: Any) -> WireType:
    """The wire type an annotation stands for: a wire type, a dataclass, an IntEnum or a
    `data_enum` (for which each variant's class stands too, and the union of all its variants,
    which is how a field holding one is typed)."""
    t = _TYPES.get(annotation)
    if t is not None:
        return t
    if isinstance(annotation, WireType):
        return annotation
    if isinstance(annotation, types.UnionType):
        return _variants_union(annotation)
    if not isinstance(annotation, type):
        raise TypeError(f"{annotation!r} is not a postcard wire type")
    if issubclass(annotation, enum.IntEnum):
        t = _UnitEnum(annotation)
    elif "_variants" in annotation.__dict__:
        t = _DataEnum(annotation)
    elif "_enum" in annotation.__dict__:
        t = wire_type(annotation.__dict__["_enum"])
    elif dataclasses.is_dataclass(annotation):
        t = _struct_of(annotation)
    else:
        raise TypeError(f"{annotation!r} is not a postcard wire type")
    _TYPES[annotation] = t
    return t


def _variants_union(annotation: types.UnionType) -> WireType:
    """The `data_enum` whose variants, all of them, make up `annotation`."""
    members = typing.get_args(annotation)
    enums = {wire_type(m) for m in members}
    t = enums.pop()
    if enums or not isinstance(t, _DataEnum) or set(members) != set(t.variants):
        raise TypeError(f"{annotation!r} is not the union of one data_enum's variants")
    return t


def _zero_field(t: WireType) -> Any:
    """A dataclass field defaulting to `t`'s zero value (a factory for the mutable ones)."""
    zero = t.zero()
    try:
        hash(zero)
    except TypeError:
        return dataclasses.field(default_factory=t.zero)
    return dataclasses.field(default=zero)


@dataclass_transform()
def struct(cls: _C) -> _C:
    """Makes `cls` a dataclass whose fields without a default default to their zero value."""
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        if name not in cls.__dict__:
            setattr(cls, name, _zero_field(wire_type(annotation)))
    setattr(cls, "_assigns_only", "__init__" not in cls.__dict__ and not hasattr(cls, "__post_init__"))
    dataclasses.dataclass(cls)  # makes `cls` a dataclass in place
    return cls


def data_enum(cls: _C) -> _C:
    """Marks `cls` as a Rust enum with data; its nested dataclasses are the variants, indexed in
    declaration order."""
    variants = tuple(v for v in cls.__dict__.values() if isinstance(v, type) and dataclasses.is_dataclass(v))
    setattr(cls, "_variants", variants)
    for v in variants:
        setattr(v, "_enum", cls)
    return cls


# The wire types by their Rust names. A type checker sees each as the type of its values.

if TYPE_CHECKING:
    _T = TypeVar("_T")
    U8: TypeAlias = int
    Bool: TypeAlias = bool
    U16: TypeAlias = int
    U32: TypeAlias = int
    U64: TypeAlias = int
    F32: TypeAlias = float
    Str: TypeAlias = str
    Bytes: TypeAlias = bytes
    Array32: TypeAlias = bytes
    Unit: TypeAlias = None
    Vec: TypeAlias = list
    Option: TypeAlias = _T | None
    from typing import Tuple as Tuple  # noqa: UP035 - `tuple` cannot be aliased with its arguments open
else:
    U8 = _U8()
    Bool = _Bool()
    U16 = _U16
    U32 = _U32
    U64 = _U64
    F32 = _F32Type()
    Str = _Str()
    Bytes = _Bytes()
    Array32 = _Array32()
    Unit = _Unit()
    Vec = _Generic(_vec_of)
    Option = _Generic(_OptionType)
    Tuple = _Generic(lambda *ts: _TupleType(ts))


# Entry points


def to_bytes(value: Any, wire: Any = None) -> bytes:
    """The postcard bytes of `value`, of type `wire` (by default its own class, a dataclass)."""
    t = wire_type(type(value) if wire is None else wire)
    out = bytearray()
    try:
        t.encode(value, out)
    except _ENCODE_ERRORS as e:
        raise _as_error(e).within(t.name) from None
    return bytes(out)


def from_bytes(cls: Any, data: Any) -> Any:
    """The `cls` value at the start of `data`; bytes after it are ignored, as Rust's
    `postcard::from_bytes` does."""
    try:
        read = _READERS[cls]
    except KeyError:
        read = _reader(cls)
    if type(data) is not bytes:
        try:
            data = bytes(memoryview(data))
        except TypeError:
            raise PostcardError(f"expected bytes, got {type(data).__name__}").within(wire_type(cls).name) from None
    try:
        return read(data)
    except PostcardError as e:
        raise e.within(wire_type(cls).name) from None


#: Each type's `value_of` once compiled, by what `from_bytes` is given: on the hot path (every
#: frame a node receives) the wire type's own lookup and attribute cost a tenth of a small decode.
_READERS: dict[Any, Callable[[bytes], Any]] = {}


def _reader(cls: Any) -> Callable[[bytes], Any]:
    t = wire_type(cls)
    if isinstance(t, _StructType):
        t.compiled_decode()  # so `value_of` below is the compiled one, not the compiling step
    read = _READERS[cls] = t.value_of
    return read


def to_plain(value: Any) -> Any:
    """`value` as plain data: structs as dicts of their fields, a data-enum variant as
    `{variant name: fields}`, sequences as lists, enums as ints. The form our cbor2 vectors and
    transcripts keep, since they outlive any one version of these classes."""
    if dataclasses.is_dataclass(value):
        fields = {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {type(value).__name__: fields} if "_enum" in type(value).__dict__ else fields
    if isinstance(value, (list, tuple)):
        return [to_plain(x) for x in value]
    if isinstance(value, enum.IntEnum):
        return int(value)
    return value
