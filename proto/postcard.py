"""Postcard, serde's compact binary format, driven by dataclass annotations.

A struct is a dataclass whose annotations are wire types (`U64`, `Vec[U32]`, another struct,
an `IntEnum` of unit variants, a `data_enum`); its fields are written in declaration order with
nothing between them. Values are plain Python: int, float, bool, str, bytes, list, tuple, None.

Every wire type has a plain `encode(v, out)` and `decode(d, p)` (returning the value and the
next offset), and these define the format: a struct loops over its fields, a list over its
elements, every varint goes through `_write_varint` and `_read_varint`, and every failure is a
`PostcardError` naming the field path and the byte offset.

Beside them are fast twins (`WireType.fast`), made only where the codec bench shows they pay:
structs, data enums and lists are compiled on first use into Python functions with their
scalars inlined, and varint lists join their bytes from a table. The fast twins track no field
path: when one fails, `to_bytes` and `from_bytes` run the plain twin on the same input, whose
error names the field, and whose answer stands. `tests/proto/test_postcard_twins.py` holds the
two equal on every type of the catalog.

To a type checker the wire types are the Python types of their values (`U64` is `int`,
`Vec[Str]` is `list[str]`), so a message's fields are typed as what they hold.
"""

import dataclasses
import enum
import functools
import operator
import threading
import types
import typing
from array import array
from collections.abc import Callable, Iterable
from struct import Struct
from struct import error as StructError
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias, TypeVar, dataclass_transform

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
_Encoder = Callable[[Any, bytearray], None]
_Decoder = Callable[[bytes, int], tuple[Any, int]]


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


def _as_error(exc: BaseException) -> PostcardError:
    """The `PostcardError` for `exc`, raised while writing a value."""
    if isinstance(exc, PostcardError):
        return exc
    return PostcardError(f"cannot encode: {type(exc).__name__}: {exc}")


#: What writing a bad value raises, in a plain twin (made a `PostcardError` by `_as_error`) or
#: a fast one.
_ENCODE_ERRORS = (TypeError, ValueError, AttributeError, OverflowError, IndexError, KeyError, StructError)
#: What a fast twin raises on bad input (`PostcardError` and `UnicodeDecodeError` are
#: `ValueError`s); a plain twin raises `PostcardError` alone.
_DECODE_ERRORS = (ValueError, IndexError, StructError)


# Varints: the plain writer and reader


def _uint(v: Any, bits: int) -> int:
    """`v` as an int of the unsigned `bits`-bit range."""
    try:
        v = operator.index(v)
    except TypeError:
        raise PostcardError(f"expected an int for u{bits}, got {type(v).__name__}") from None
    if not 0 <= v < 1 << bits:
        raise PostcardError(f"{v} is out of the u{bits} range")
    return v


def _write_varint(v: Any, bits: int) -> bytes:
    """The LEB128 bytes of `v`, an int of the unsigned `bits`-bit range: seven bits a byte, the
    lowest first, the top bit set on every byte but the last."""
    v = _uint(v, bits)
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _read_varint(d: bytes, p: int, bits: int) -> tuple[int, int]:
    """The `bits`-bit varint at offset `p` of `d`, and the offset after it: at most ceil(bits/7)
    bytes, the last of which may hold only the bits that remain. A longer encoding of a value
    (`80 00` for 0) reads as Rust reads it."""
    size = -(-bits // 7)
    value = 0
    for i in range(size):
        if p + i >= len(d):
            raise _eof(len(d))
        b = d[p + i]
        value |= (b & 0x7F) << 7 * i
        if b < 0x80:
            if i == size - 1 and b >> (bits - 7 * i):
                raise PostcardError(f"varint above the u{bits} range", p)
            return value, p + i + 1
    raise PostcardError(f"varint longer than {size} bytes", p)


def _read_len(d: bytes, p: int) -> tuple[int, int]:
    """A length prefix at `p` (a `usize`, written as a u64 varint), and the offset after it."""
    return _read_varint(d, p, 64)


def _read_span(d: bytes, p: int) -> tuple[int, int]:
    """A length prefix at `p` and the offsets of that many bytes after it."""
    n, q = _read_len(d, p)
    if n > len(d) - q:
        raise PostcardError(f"length {n} runs past the end ({len(d) - q} bytes left)", p)
    return q, q + n


_SMALL = 1 << 14
#: The varint of every value below 2**14, by value, for the fast twins.
_VARINT = [_write_varint(v, 14) for v in range(_SMALL)]
#: The first two bytes of every longer varint, by its low 14 bits.
_LOW14 = [bytes([v & 0x7F | 0x80, v >> 7 | 0x80]) for v in range(_SMALL)]


def _len_prefix(n: int) -> bytes:
    """The length prefix of `n` bytes or elements."""
    return _VARINT[n] if n < _SMALL else _write_varint(n, 64)


def _read_bool(d: bytes, p: int) -> bool:
    if d[p] > 1:
        raise PostcardError(f"invalid bool byte 0x{d[p]:02x}", p)
    return d[p] == 1


def _write_bool(v: Any) -> bytes:
    if v is True:
        return b"\x01"
    if v is False:
        return b"\x00"
    raise PostcardError(f"expected a bool, got {type(v).__name__}")


_F32 = Struct("<f")


# Generated code, for the fast twins


def _function(ns: dict[str, Any], signature: str, body: list[str]) -> Callable[..., Any]:
    """The function `def {signature}:` with `body`, compiled in namespace `ns`."""
    name = signature.partition("(")[0]
    source = "\n".join([f"def {signature}:", *_indent(body, 1)])
    exec(compile(source, f"<postcard {name}>", "exec"), ns)
    return ns.pop(name)


def _indent(lines: Iterable[str], levels: int) -> list[str]:
    pad = "    " * levels
    return [pad + line for line in lines]


def _code_ns() -> tuple[dict[str, Any], _Ref]:
    """A namespace for generated code, holding what `enc_src` / `dec_src` lines call by name,
    and the `ref` naming anything else in it."""
    ns: dict[str, Any] = {
        "_VARINT": _VARINT,
        "_LOW14": _LOW14,
        "_F32": _F32,
        "_len_prefix": _len_prefix,
        "_read_bool": _read_bool,
        "_write_bool": _write_bool,
        "PostcardError": PostcardError,
    }

    def ref(obj: object) -> str:
        name = f"_r{len(ns)}"
        ns[name] = obj
        return name

    return ns, ref


def _varint_src(bits: int, to: str) -> list[str]:
    """Source lines reading the `bits`-bit varint at offset `p` of bytes `d` into local `to` and
    moving `p` past it, as `_read_varint` does; reading past the end is an `IndexError`.

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


# Wire types


class _Fast(NamedTuple):
    """A type's fast twins: `encode` and `decode` as the plain ones, and `read`, the value at
    the start of some bytes. They may fail with any of `_ENCODE_ERRORS` / `_DECODE_ERRORS`."""

    encode: _Encoder
    decode: _Decoder
    read: Callable[[bytes], Any]


def _reader_of(decode: _Decoder) -> Callable[[bytes], Any]:
    return lambda d: decode(d, 0)[0]


class WireType:
    """How one Rust type is written; `name` spells it as Rust does, for messages.

    `encode` and `decode` are the plain twins. `enc_src` / `dec_src` give the source lines a
    compiled twin inlines for a value of this type: writing local `x` to bytearray `out`, or
    reading local `to` from bytes `d` at offset `p` and advancing `p`; `ref(obj)` names `obj` in
    the compiled code's namespace. By default they call the type's fast twins.
    """

    name = "?"
    _fast: _Fast | None = None

    def zero(self) -> Any:
        raise NotImplementedError

    def encode(self, v: Any, out: bytearray) -> None:
        raise NotImplementedError

    def decode(self, d: bytes, p: int) -> tuple[Any, int]:
        raise NotImplementedError

    def zero_sized(self) -> bool:
        """Whether every value of this type is written as no bytes at all."""
        return False

    def fast(self) -> _Fast:
        """The fast twins, made on first use; threads racing here each make a set and store it
        whole."""
        fast = self._fast
        if fast is None:
            fast = self._fast = self.make_fast()
        return fast

    def make_fast(self) -> _Fast:
        """The fast twins; for a type without any, the plain ones."""
        return _Fast(self.encode, self.decode, _reader_of(self.decode))

    def enc_src(self, ref: _Ref) -> list[str]:
        return [f"{ref(self.fast().encode)}(x, out)"]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        return [f"{to}, p = {ref(self.fast().decode)}(d, p)"]

    def __repr__(self) -> str:
        return self.name


class _Inlined(WireType):
    """A type whose fast twins are the source it inlines into others, compiled on its own."""

    def make_fast(self) -> _Fast:
        ns, ref = _code_ns()
        return _Fast(
            _function(ns, "encode(x, out)", self.enc_src(ref)),
            _function(ns, "decode(d, p)", [*self.dec_src(ref, "v"), "return v, p"]),
            _function(ns, "read(d)", ["p = 0", *self.dec_src(ref, "v"), "return v"]),
        )


#: Source writing the varint of `x` from the tables: one of 3-4 bytes, one of 5-6.
_LOW14_ONCE = "_LOW14[x & 0x3FFF] + _VARINT[x >> 14]"
_LOW14_TWICE = "_LOW14[x & 0x3FFF] + _LOW14[x >> 14 & 0x3FFF] + _VARINT[x >> 28]"


class _Varint(_Inlined):
    """An unsigned int of `bits` bits, as a LEB128 varint."""

    def __init__(self, bits: int) -> None:
        self.name = f"u{bits}"
        self.bits = bits

    def zero(self) -> int:
        return 0

    def encode(self, v: Any, out: bytearray) -> None:
        out += _write_varint(v, self.bits)

    def decode(self, d: bytes, p: int) -> tuple[int, int]:
        return _read_varint(d, p, self.bits)

    def enc_src(self, ref: _Ref) -> list[str]:
        # Up to six bytes without a call, from the tables 14 bits a lookup: a node's counts and
        # clocks are nearly all under 2^28 and its bytes of memory under 2^42, and the call
        # costs more than the writing. Only an int takes the longer ways; the plain writer takes
        # the rest, and refuses what is bad.
        write = f"{ref(_write_varint)}(x, {self.bits})"
        for low, lookup in [(1 << 28, _LOW14_TWICE), (_SMALL, _LOW14_ONCE)]:
            if low < 1 << self.bits:
                high = min(low << 14, 1 << self.bits)
                write = f"({lookup}) if type(x) is int and {low} <= x < {high} else {write}"
        return [f"out += _VARINT[x] if 0 <= x < {_SMALL} else {write}"]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        return _varint_src(self.bits, to)


class _U8(_Inlined):
    name = "u8"

    def zero(self) -> int:
        return 0

    def encode(self, v: Any, out: bytearray) -> None:
        out.append(_uint(v, 8))

    def decode(self, d: bytes, p: int) -> tuple[int, int]:
        if p >= len(d):
            raise _eof(p)
        return d[p], p + 1

    def enc_src(self, ref: _Ref) -> list[str]:
        return ["out.append(x)"]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        return [f"{to} = d[p]", "p += 1"]


class _Bool(_Inlined):
    name = "bool"

    def zero(self) -> bool:
        return False

    def encode(self, v: Any, out: bytearray) -> None:
        out += _write_bool(v)

    def decode(self, d: bytes, p: int) -> tuple[bool, int]:
        if p >= len(d):
            raise _eof(p)
        return _read_bool(d, p), p + 1

    def enc_src(self, ref: _Ref) -> list[str]:
        return ["out += _write_bool(x)"]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        return [f"{to} = _read_bool(d, p)", "p += 1"]


class _F32Type(_Inlined):
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


class _VecType(WireType):
    """`Vec<T>`: the length, then each element. The fast twins inline the element in a loop."""

    def __init__(self, elem: WireType) -> None:
        self.elem = elem
        self.name = f"Vec<{elem.name}>"

    def zero(self) -> list[Any]:
        return []

    def encode(self, v: Any, out: bytearray) -> None:
        out += _len_prefix(len(v))
        for i, x in enumerate(v):
            try:
                self.elem.encode(x, out)
            except _ENCODE_ERRORS as e:
                raise _as_error(e).within(f"[{i}]") from None

    def decode(self, d: bytes, p: int) -> tuple[list[Any], int]:
        n, p = _read_len(d, p)
        if n > len(d) - p:
            if self.elem.zero_sized():
                return self._zero_sized_run(d, p, n)
            raise PostcardError(f"{n} elements cannot fit in the {len(d) - p} bytes left", p)
        out = []
        for i in range(n):
            try:
                x, p = self.elem.decode(d, p)
            except PostcardError as e:
                raise e.within(f"[{i}]") from None
            out.append(x)
        return out, p

    def _zero_sized_run(self, d: bytes, p: int, n: int) -> tuple[list[Any], int]:
        """`n` elements that take no bytes, as upstream postcard reads them: however many the
        length says, with no input behind them. (No message of the catalog has such a list, so
        no peer can make the node build one.)"""
        try:
            return [self.elem.decode(d, p)[0] for _ in range(n)], p
        except MemoryError:
            raise PostcardError(f"{n} elements of {self.elem.name} do not fit in memory", p) from None

    def make_fast(self) -> _Fast:
        ns, ref = _code_ns()
        write = ["out += _len_prefix(len(v))", "for x in v:", *_indent(self.elem.enc_src(ref), 1)]
        encode = _function(ns, "encode(v, out)", write)
        loop = [*self.elem.dec_src(ref, "x"), "o.append(x)"]
        body = [*self._length_src(ref), "o = []", "for _ in range(n):", *_indent(loop, 1), "return o, p"]
        decode = _function(ns, "decode(d, p)", body)
        return _Fast(encode, decode, _reader_of(decode))

    def _length_src(self, ref: _Ref) -> list[str]:
        """Source reading the length `n` at `p`; one past the end of the input (an error, or a
        run of zero-sized elements) goes to the plain twin."""
        return ["start = p", *_U64.dec_src(ref, "n"), "if n > len(d) - p:", f"    return {ref(self.decode)}(d, start)"]


#: The varint of every value a varint list's fast twin has written, by value: the first 2**14
#: at import, the rest at first sight up to `_TABLE_MAX` (2 MiB of slots at the most, a
#: vocabulary's worth), a None in between. A list, not a dict: on a streaming node the dict's
#: lookups, their entries out of cache, were a large share of its time.
_TABLE_MAX = 1 << 18
_TABLE: list[bytes | None] = list(_VARINT)
_TABLE_GROWING = threading.Lock()
#: A value's varint from the table: a value not in it yet is a None there, which `join`
#: refuses, or past its end.
_table_lookup = typing.cast(Callable[[int], bytes], _TABLE.__getitem__)


def _table_varint(x: int, bits: int) -> bytes:
    """The varint of `x`, from the table, written into it at first sight."""
    if x >= _TABLE_MAX:
        return _write_varint(x, bits)
    if x >= len(_TABLE):
        with _TABLE_GROWING:  # two threads growing it at once would each add what they saw missing
            _TABLE.extend([None] * (x + 1 - len(_TABLE)))
    b = _TABLE[x]
    if b is None:
        b = _TABLE[x] = _write_varint(x, bits)
    return b


def _array_code(bits: int) -> str:
    """The `array` type code of unsigned ints of `bits` bits."""
    return next(code for code in "BHILQ" if array(code).itemsize * 8 == bits)


class _VarintVec(_VecType):
    """`Vec<u16|u32|u64>`, token lists above all. The fast twins check the whole list with
    `array` and join its varints from the table in C, and read a run of one-byte varints in one
    step. Any sequence of ints is written, bytes included."""

    def __init__(self, elem: _Varint) -> None:
        super().__init__(elem)
        self.bits = elem.bits
        self.code = _array_code(elem.bits)

    def _write_joined(self, v: Any, out: bytearray) -> None:
        array(self.code, v)  # refuses a value out of range (a negative one would index the table from its end)
        out += _len_prefix(len(v))
        try:
            out += b"".join(map(_table_lookup, v))
        except (TypeError, IndexError):  # a value not in the table yet
            out += b"".join([_table_varint(x, self.bits) for x in v])

    def make_fast(self) -> _Fast:
        ns, ref = _code_ns()
        loop = [*self.elem.dec_src(ref, "x"), "o[i] = x"]
        run = ["run = d[p : p + n]", "if run.isascii():", "    return list(run), p + n"]  # every value one byte
        body = [*self._length_src(ref), *run, "o = [0] * n", "for i in range(n):", *_indent(loop, 1), "return o, p"]
        decode = _function(ns, "decode(d, p)", body)
        return _Fast(self._write_joined, decode, _reader_of(decode))


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
        out += _write_varint(v, 32)

    def decode(self, d: bytes, p: int) -> tuple[enum.IntEnum, int]:
        i, q = _read_varint(d, p, 32)
        if i >= len(self.members):
            raise PostcardError(f"unknown {self.name} variant {i}", p)
        return self.members[i], q


class _DataEnum(_Inlined):
    """A Rust enum with data: the variant index as a varint, then the variant's fields.

    Each variant is a dataclass; a newtype variant is one with a single field, which postcard
    writes exactly as the wrapped value. An error's path goes on with the variant's fields.
    """

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name = cls.__name__
        self.variants: tuple[type, ...] = cls._variants  # type: ignore[attr-defined]
        self.structs = [_struct_of(v) for v in self.variants]
        self.index = {v: i for i, v in enumerate(self.variants)}

    def zero(self) -> Any:
        return self.variants[0]()

    def encode(self, v: Any, out: bytearray) -> None:
        i = self.index.get(type(v))
        if i is None:
            raise PostcardError(f"expected a {self.name} variant, got {type(v).__name__}")
        out += _write_varint(i, 32)
        self.structs[i].encode(v, out)

    def decode(self, d: bytes, p: int) -> tuple[Any, int]:
        i, q = _read_varint(d, p, 32)
        if i >= len(self.structs):
            raise PostcardError(f"unknown {self.name} variant {i}", p)
        return self.structs[i].decode(d, q)

    def enc_src(self, ref: _Ref) -> list[str]:
        # Each variant's index bytes and fields' fast encoder, by its class.
        writers = {v: (_VARINT[i], self.structs[i].fast().encode) for v, i in self.index.items()}
        return [f"w = {ref(writers)}[type(x)]", "out += w[0]", "w[1](x, out)"]

    def dec_src(self, ref: _Ref, to: str) -> list[str]:
        # An index of one byte, as every catalog enum's is, picks the variant's fast decoder;
        # any other goes to the plain twin.
        readers = tuple(s.fast().decode for s in self.structs)
        return [
            f"if d[p] < {len(readers)}:",
            f"    {to}, p = {ref(readers)}[d[p]](d, p + 1)",
            "else:",
            f"    {to}, p = {ref(self.decode)}(d, p)",
        ]


# Structs


class _StructType(WireType):
    """A dataclass: its fields in declaration order."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name = cls.__name__

    def zero(self) -> Any:
        return self.cls()

    def zero_sized(self) -> bool:
        return all(t.zero_sized() for _, t in self.fields)

    @functools.cached_property
    def fields(self) -> list[tuple[str, WireType]]:
        """Each field's name and wire type, in declaration order."""
        return [(f.name, wire_type(f.type)) for f in dataclasses.fields(self.cls)]

    def encode(self, v: Any, out: bytearray) -> None:
        for name, t in self.fields:
            try:
                t.encode(getattr(v, name), out)
            except _ENCODE_ERRORS as e:
                raise _as_error(e).within(f".{name}") from None

    def decode(self, d: bytes, p: int) -> tuple[Any, int]:
        values = []
        for name, t in self.fields:
            try:
                x, p = t.decode(d, p)
            except PostcardError as e:
                raise e.within(f".{name}") from None
            values.append(x)
        return self.cls(*values), p

    def make_fast(self) -> _Fast:
        ns, ref = _code_ns()
        ns.update(NEW=self.cls, _new=object.__new__)
        source = _struct_source(self.fields, ref, _assigns_only(self.cls))
        exec(compile(source, f"<postcard {self.name}>", "exec"), ns)
        return _Fast(ns["encode"], ns["decode"], ns["read"])


def _struct_source(fields: list[tuple[str, WireType]], ref: _Ref, assign: bool) -> str:
    """The source of the fast twins `encode(v, out)`, `decode(d, p)` and `read(d)` (`decode` at
    offset 0 returning the value alone, the top level's shortcut) of a struct of `fields`, with
    their scalars inlined. With `assign`, decoding sets the fields on a bare instance rather
    than calling the class."""
    encode = ["def encode(v, out):"] + ([] if fields else ["    pass"])
    body = []
    for i, (name, t) in enumerate(fields):
        encode += _indent([f"x = v.{name}", *t.enc_src(ref)], 1)
        body += _indent(t.dec_src(ref, f"x{i}"), 1)
    if assign:
        build = ["    o = _new(NEW)"] + [f"    o.{name} = x{i}" for i, (name, _) in enumerate(fields)]
    else:
        build = ["    o = NEW(" + ", ".join(f"x{i}" for i in range(len(fields))) + ")"]
    decode = ["def decode(d, p):", *body, *build, "    return o, p"]
    read = ["def read(d):", "    p = 0", *body, *build, "    return o"]
    return "\n".join(encode + decode + read)


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
    key = type(value) if wire is None else wire
    try:
        write = _WRITERS[key]
    except KeyError:
        write = _WRITERS[key] = wire_type(key).fast().encode
    out = bytearray()
    try:
        write(value, out)
        return bytes(out)
    except _ENCODE_ERRORS:
        pass  # the plain twin says which field is wrong
    return _encode_plainly(wire_type(key), value)


def from_bytes(cls: Any, data: Any) -> Any:
    """The `cls` value at the start of `data`; bytes after it are ignored, as Rust's
    `postcard::from_bytes` does."""
    try:
        read = _READERS[cls]
    except KeyError:
        read = _READERS[cls] = wire_type(cls).fast().read
    if type(data) is not bytes:
        try:
            data = bytes(memoryview(data))
        except TypeError:
            raise PostcardError(f"expected bytes, got {type(data).__name__}").within(wire_type(cls).name) from None
    try:
        return read(data)
    except _DECODE_ERRORS:
        pass  # the plain twin says which field is wrong, and where
    return _decode_plainly(wire_type(cls), data)


#: Each type's fast twins by what `to_bytes` and `from_bytes` are given: on the hot path (every
#: frame a node sends and receives) the wire type's own lookup and attribute cost a tenth of a
#: small message.
_WRITERS: dict[Any, _Encoder] = {}
_READERS: dict[Any, Callable[[bytes], Any]] = {}


def _encode_plainly(t: WireType, value: Any) -> bytes:
    out = bytearray()
    try:
        t.encode(value, out)
    except _ENCODE_ERRORS as e:
        raise _as_error(e).within(t.name) from None
    return bytes(out)


def _decode_plainly(t: WireType, data: bytes) -> Any:
    try:
        return t.decode(data, 0)[0]
    except PostcardError as e:
        raise e.within(t.name) from None


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
