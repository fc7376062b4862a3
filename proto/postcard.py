"""Postcard, serde's compact binary format, driven by dataclass annotations.

A struct is a dataclass whose annotations are wire types (`U64`, `Vec[U32]`, another struct,
an `IntEnum` of unit variants, a `data_enum`); its fields are written in declaration order with
nothing between them. Values are plain Python: int, float, bool, str, bytes, list, tuple, None.

Each struct's encoder and decoder are compiled once, on first use, into Python functions with
the scalar fields inlined; containers call their element type's own `encode` / `decode`.
Decoding takes `(data, offset)` and returns `(value, next_offset)`; every failure is a
`PostcardError` naming the field path and the byte offset.
"""

import dataclasses
import enum
from struct import Struct
from struct import error as StructError

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
]


class PostcardError(ValueError):
    """A value that cannot be written, or bytes that are not a valid encoding.

    `path` grows from the innermost field outwards (`.lease.duration_ms`, `[3]`); the top level
    prefixes the type name.
    """

    def __init__(self, reason, offset=None):
        super().__init__(reason)
        self.reason = reason
        self.offset = offset
        self.path = ""

    def within(self, segment):
        self.path = segment + self.path
        return self

    def __str__(self):
        where = "" if self.offset is None else f" at offset {self.offset}"
        head = f"{self.path}: " if self.path else ""
        return f"{head}{self.reason}{where}"


def _eof(offset):
    return PostcardError("unexpected end of input", offset)


def _as_error(exc, offset=None):
    """The `PostcardError` for `exc`, raised while writing or (with `offset`) reading a value."""
    if isinstance(exc, PostcardError):
        return exc
    if offset is not None and isinstance(exc, (IndexError, StructError)):
        return _eof(offset)
    return PostcardError(f"cannot encode: {type(exc).__name__}: {exc}")


_ENCODE_ERRORS = (TypeError, ValueError, AttributeError, OverflowError, IndexError, KeyError, StructError)
_DECODE_ERRORS = (PostcardError, IndexError, StructError)


# Varints

_SMALL = 1 << 14
_VARINT = [bytes([v]) if v < 0x80 else bytes([v & 0x7F | 0x80, v >> 7]) for v in range(_SMALL)]


def _write_varint(v, bits):
    """The LEB128 bytes of `v`, which must be an int in the unsigned `bits`-bit range."""
    if not isinstance(v, int):
        raise PostcardError(f"expected an int for u{bits}, got {type(v).__name__}")
    if not 0 <= v < 1 << bits:
        raise PostcardError(f"{v} is out of the u{bits} range")
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _varint_reader(bits):
    """A reader of a `bits`-bit varint at `p` of `d`: at most ceil(bits/7) bytes, the last one
    holding only the bits that remain."""
    size = -(-bits // 7)
    last_max = (1 << (bits - 7 * (size - 1))) - 1

    def read(d, p):
        v = shift = 0
        end = len(d)
        for q in range(p, p + size):
            if q >= end:
                raise _eof(q)
            b = d[q]
            v |= (b & 0x7F) << shift
            if b < 0x80:
                if q == p + size - 1 and b > last_max:
                    raise PostcardError(f"varint above the u{bits} range", p)
                return v, q + 1
            shift += 7
        raise PostcardError(f"varint longer than {size} bytes", p)

    return read


_read_len = _varint_reader(64)


def _read_span(d, p):
    """A length prefix at `p` and the offsets of that many bytes after it."""
    n, q = _read_len(d, p)
    if n > len(d) - q:
        raise PostcardError(f"length {n} runs past the end ({len(d) - q} bytes left)", p)
    return q, q + n


# Wire types


class WireType:
    """How one Rust type is written; `name` spells it as Rust does, for messages.

    `enc_src` / `dec_src` give the source lines a compiled struct inlines for a field of this
    type: writing local `x` to bytearray `out`, or reading `x` from bytes `d` at offset `p` and
    advancing `p`. `ref(obj)` names `obj` in the compiled code's namespace. The default calls the
    type's own `encode` / `decode`.
    """

    name = "?"

    def zero(self):
        raise NotImplementedError

    def encode(self, v, out):
        raise NotImplementedError

    def decode(self, d, p):
        raise NotImplementedError

    def enc_src(self, ref):
        return [f"{ref(self.encode)}(x, out)"]

    def dec_src(self, ref):
        return [f"x, p = {ref(self.decode)}(d, p)"]

    def __repr__(self):
        return self.name


class _Varint(WireType):
    def __init__(self, bits):
        self.name = f"u{bits}"
        self.bits = bits
        self.read = _varint_reader(bits)

    def zero(self):
        return 0

    def write(self, v):
        return _write_varint(v, self.bits)

    def encode(self, v, out):
        out += _VARINT[v] if 0 <= v < _SMALL else self.write(v)

    def decode(self, d, p):
        if p >= len(d):
            raise _eof(p)
        b = d[p]
        return (b, p + 1) if b < 0x80 else self.read(d, p)

    def enc_src(self, ref):
        return [f"out += _VARINT[x] if 0 <= x < {_SMALL} else {ref(self.write)}(x)"]

    def dec_src(self, ref):
        return ["x = d[p]", "if x < 0x80: p += 1", f"else: x, p = {ref(self.read)}(d, p)"]


class _U8(WireType):
    name = "u8"

    def zero(self):
        return 0

    def encode(self, v, out):
        out.append(v)

    def decode(self, d, p):
        if p >= len(d):
            raise _eof(p)
        return d[p], p + 1

    def enc_src(self, ref):
        return ["out.append(x)"]

    def dec_src(self, ref):
        return ["x = d[p]", "p += 1"]


def _check_bool(b, p):
    if b > 1:
        raise PostcardError(f"invalid bool byte 0x{b:02x}", p)
    return b == 1


def _write_bool(v):
    if v is True:
        return b"\x01"
    if v is False:
        return b"\x00"
    raise PostcardError(f"expected a bool, got {type(v).__name__}")


class _Bool(WireType):
    name = "bool"

    def zero(self):
        return False

    def encode(self, v, out):
        out += _write_bool(v)

    def decode(self, d, p):
        if p >= len(d):
            raise _eof(p)
        return _check_bool(d[p], p), p + 1

    def enc_src(self, ref):
        return ["out += _write_bool(x)"]

    def dec_src(self, ref):
        return ["x = _check_bool(d[p], p)", "p += 1"]


_F32 = Struct("<f")


class _F32Type(WireType):
    name = "f32"

    def zero(self):
        return 0.0

    def encode(self, v, out):
        out += _F32.pack(v)

    def decode(self, d, p):
        if len(d) - p < 4:
            raise _eof(p)
        return _F32.unpack_from(d, p)[0], p + 4

    def enc_src(self, ref):
        return ["out += _F32.pack(x)"]

    def dec_src(self, ref):
        return ["x = _F32.unpack_from(d, p)[0]", "p += 4"]


class _Str(WireType):
    name = "String"

    def zero(self):
        return ""

    def encode(self, v, out):
        if not isinstance(v, str):
            raise PostcardError(f"expected a str, got {type(v).__name__}")
        b = v.encode()
        n = len(b)
        out += _VARINT[n] if n < _SMALL else _write_varint(n, 64)
        out += b

    def decode(self, d, p):
        q, end = _read_span(d, p)
        try:
            return d[q:end].decode(), end
        except UnicodeDecodeError as e:
            raise PostcardError(f"invalid UTF-8 ({e.reason})", q + e.start) from None


class _Bytes(WireType):
    name = "Vec<u8>"

    def zero(self):
        return b""

    def encode(self, v, out):
        n = len(v)
        out += _VARINT[n] if n < _SMALL else _write_varint(n, 64)
        out += v

    def decode(self, d, p):
        q, end = _read_span(d, p)
        return d[q:end], end


class _Array32(WireType):
    name = "[u8; 32]"

    def zero(self):
        return bytes(32)

    def encode(self, v, out):
        if len(v) != 32:
            raise PostcardError(f"expected 32 bytes, got {len(v)}")
        out += v

    def decode(self, d, p):
        if len(d) - p < 32:
            raise _eof(p)
        return d[p : p + 32], p + 32


class _Unit(WireType):
    """Rust's `()`: no bytes; the Python value is None."""

    name = "()"

    def zero(self):
        return None

    def encode(self, v, out):
        if v is not None:
            raise PostcardError(f"expected None for (), got {type(v).__name__}")

    def decode(self, d, p):
        return None, p


U8 = _U8()
Bool = _Bool()
U16 = _Varint(16)
U32 = _Varint(32)
U64 = _Varint(64)
F32 = _F32Type()
Str = _Str()
Bytes = _Bytes()
Array32 = _Array32()
Unit = _Unit()


class _VecType(WireType):
    def __init__(self, elem):
        self.elem = elem
        self.name = f"Vec<{elem.name}>"

    def zero(self):
        return []

    def encode(self, v, out):
        n = len(v)
        out += _VARINT[n] if n < _SMALL else _write_varint(n, 64)
        put = self.elem.encode
        for i, x in enumerate(v):
            try:
                put(x, out)
            except _ENCODE_ERRORS as e:
                raise _as_error(e).within(f"[{i}]") from None

    def decode(self, d, p):
        n, p = _read_len(d, p)
        if n > len(d) - p:
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


class _VarintVec(_VecType):
    """`Vec<u16|u32|u64>`, token lists above all, with the one-byte case read inline."""

    def decode(self, d, p):
        n, p = _read_len(d, p)
        if n > len(d) - p:
            raise PostcardError(f"{n} elements cannot fit in the {len(d) - p} bytes left", p)
        run = d[p : p + n]
        if run.isascii():
            return list(run), p + n
        read = self.elem.read
        out = []
        append = out.append
        for i in range(n):
            if p >= len(d):
                raise _eof(p).within(f"[{i}]")
            b = d[p]
            if b < 0x80:
                append(b)
                p += 1
            else:
                try:
                    b, p = read(d, p)
                except PostcardError as e:
                    raise e.within(f"[{i}]") from None
                append(b)
        return out, p


class _OptionType(WireType):
    def __init__(self, inner):
        self.inner = inner
        self.name = f"Option<{inner.name}>"

    def zero(self):
        return None

    def encode(self, v, out):
        if v is None:
            out.append(0)
        else:
            out.append(1)
            self.inner.encode(v, out)

    def decode(self, d, p):
        if p >= len(d):
            raise _eof(p)
        tag = d[p]
        if tag == 0:
            return None, p + 1
        if tag != 1:
            raise PostcardError(f"invalid Option tag 0x{tag:02x}", p)
        return self.inner.decode(d, p + 1)


class _TupleType(WireType):
    def __init__(self, elems):
        self.elems = elems
        self.name = "(" + ", ".join(t.name for t in elems) + ")"

    def zero(self):
        return tuple(t.zero() for t in self.elems)

    def encode(self, v, out):
        if len(v) != len(self.elems):
            raise PostcardError(f"expected a {len(self.elems)}-tuple, got {len(v)} items")
        for i, (t, x) in enumerate(zip(self.elems, v)):
            try:
                t.encode(x, out)
            except _ENCODE_ERRORS as e:
                raise _as_error(e).within(f".{i}") from None

    def decode(self, d, p):
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

    def __init__(self, make):
        self.make = make
        self.cache = {}

    def __getitem__(self, args):
        key = args if isinstance(args, tuple) else (args,)
        if key not in self.cache:
            self.cache[key] = self.make(*map(wire_type, key))
        return self.cache[key]


Vec = _Generic(lambda t: (_VarintVec if isinstance(t, _Varint) else _VecType)(t))
Option = _Generic(_OptionType)
Tuple = _Generic(lambda *ts: _TupleType(ts))


class _UnitEnum(WireType):
    """An `IntEnum` of unit variants: the variant index as a varint."""

    def __init__(self, cls):
        self.cls = cls
        self.name = cls.__name__
        self.members = tuple(cls)
        if [int(m) for m in self.members] != list(range(len(self.members))):
            raise TypeError(f"{cls.__name__}: values must be 0, 1, 2, ... in declaration order")

    def zero(self):
        return self.members[0]

    def encode(self, v, out):
        if not isinstance(v, self.cls):
            raise PostcardError(f"expected a {self.name}, got {type(v).__name__}")
        out += _VARINT[v]

    def decode(self, d, p):
        i, q = U32.decode(d, p)
        if i >= len(self.members):
            raise PostcardError(f"unknown {self.name} variant {i}", p)
        return self.members[i], q


class _DataEnum(WireType):
    """A Rust enum with data: the variant index as a varint, then the variant's fields.

    Each variant is a dataclass; a newtype variant is one with a single field, which postcard
    writes exactly as the wrapped value.
    """

    def __init__(self, cls):
        self.cls = cls
        self.name = cls.__name__
        self.variants = cls._variants
        self.index = {v: i for i, v in enumerate(self.variants)}

    def zero(self):
        return self.variants[0]()

    def encode(self, v, out):
        i = self.index.get(type(v))
        if i is None:
            raise PostcardError(f"expected a {self.name} variant, got {type(v).__name__}")
        out += _VARINT[i]
        try:
            _struct_of(type(v)).encode(v, out)
        except PostcardError as e:
            raise e.within(f".{type(v).__name__}") from None

    def decode(self, d, p):
        i, q = U32.decode(d, p)
        if i >= len(self.variants):
            raise PostcardError(f"unknown {self.name} variant {i}", p)
        variant = self.variants[i]
        try:
            return _struct_of(variant).decode(d, q)
        except PostcardError as e:
            raise e.within(f".{variant.__name__}") from None


# Structs


class _StructType(WireType):
    """A dataclass, compiled on first use into an encoder and a decoder with inlined scalars."""

    def __init__(self, cls):
        self.cls = cls
        self.name = cls.__name__
        self.encode = self._compile_then("encode")
        self.decode = self._compile_then("decode")

    def zero(self):
        return self.cls()

    def _compile_then(self, which):
        def first_call(*args):
            self._compile()
            return getattr(self, which)(*args)

        return first_call

    def _compile(self):
        fields = [(f.name, wire_type(f.type)) for f in dataclasses.fields(self.cls)]
        ns = {
            "_VARINT": _VARINT,
            "_F32": _F32,
            "_check_bool": _check_bool,
            "_write_bool": _write_bool,
            "_as_error": _as_error,
            "_ENCODE_ERRORS": _ENCODE_ERRORS,
            "_DECODE_ERRORS": _DECODE_ERRORS,
            "NEW": self.cls,
            "FIELDS": tuple("." + name for name, _ in fields),
        }

        def ref(obj):
            name = f"_r{len(ns)}"
            ns[name] = obj
            return name

        exec(_struct_source(fields, ref), ns)
        self.encode, self.decode = ns["encode"], ns["decode"]


def _struct_source(fields, ref):
    enc = ["def encode(v, out):", "    i = 0", "    try:"]
    dec = ["def decode(d, p):", "    i = 0", "    try:"]
    for i, (name, t) in enumerate(fields):
        enc += [f"        i = {i}", f"        x = v.{name}"]
        enc += ["        " + line for line in t.enc_src(ref)]
        dec += [f"        i = {i}"]
        dec += ["        " + line for line in t.dec_src(ref)]
        dec += [f"        x{i} = x"]
    enc += ["    except _ENCODE_ERRORS as e:", "        raise _as_error(e).within(FIELDS[i]) from None"]
    dec += ["    except _DECODE_ERRORS as e:", "        raise _as_error(e, p).within(FIELDS[i]) from None"]
    dec += ["    return NEW(" + ", ".join(f"x{i}" for i in range(len(fields))) + "), p"]
    if not fields:
        enc = ["def encode(v, out):", "    pass"]
        dec = ["def decode(d, p):", "    return NEW(), p"]
    return "\n".join(enc + dec) + "\n"


_STRUCTS = {}
_TYPES = {}


def _struct_of(cls):
    """The fields of dataclass `cls` as a struct (for a variant: without its index)."""
    t = _STRUCTS.get(cls)
    if t is None:
        t = _STRUCTS[cls] = _StructType(cls)
    return t


def wire_type(annotation):
    """The wire type an annotation stands for: a wire type, a dataclass, an IntEnum or a
    `data_enum`."""
    if isinstance(annotation, WireType):
        return annotation
    t = _TYPES.get(annotation)
    if t is not None:
        return t
    if not isinstance(annotation, type):
        raise TypeError(f"{annotation!r} is not a postcard wire type")
    if issubclass(annotation, enum.IntEnum):
        t = _UnitEnum(annotation)
    elif "_variants" in annotation.__dict__:
        t = _DataEnum(annotation)
    elif "_enum" in annotation.__dict__:
        t = wire_type(annotation._enum)
    elif dataclasses.is_dataclass(annotation):
        t = _struct_of(annotation)
    else:
        raise TypeError(f"{annotation!r} is not a postcard wire type")
    _TYPES[annotation] = t
    return t


def _zero_field(t):
    """A dataclass field defaulting to `t`'s zero value (a factory for the mutable ones)."""
    zero = t.zero()
    try:
        hash(zero)
    except TypeError:
        return dataclasses.field(default_factory=t.zero)
    return dataclasses.field(default=zero)


def struct(cls):
    """Makes `cls` a dataclass whose fields without a default default to their zero value."""
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        if name not in cls.__dict__:
            setattr(cls, name, _zero_field(wire_type(annotation)))
    return dataclasses.dataclass(cls)


def data_enum(cls):
    """Marks `cls` as a Rust enum with data; its nested dataclasses are the variants, indexed in
    declaration order."""
    cls._variants = tuple(
        v for v in cls.__dict__.values() if isinstance(v, type) and dataclasses.is_dataclass(v)
    )
    for v in cls._variants:
        v._enum = cls
    return cls


# Entry points


def to_bytes(value, wire=None):
    """The postcard bytes of `value`, of type `wire` (by default its own class, a dataclass)."""
    t = wire_type(type(value) if wire is None else wire)
    out = bytearray()
    try:
        t.encode(value, out)
    except _ENCODE_ERRORS as e:
        raise _as_error(e).within(t.name) from None
    return bytes(out)


def from_bytes(cls, data):
    """The `cls` value at the start of `data`; bytes after it are ignored, as Rust's
    `postcard::from_bytes` does."""
    t = wire_type(cls)
    if type(data) is not bytes:
        try:
            data = bytes(memoryview(data))
        except TypeError:
            raise PostcardError(f"expected bytes, got {type(data).__name__}").within(t.name) from None
    try:
        return t.decode(data, 0)[0]
    except PostcardError as e:
        raise e.within(t.name) from None
