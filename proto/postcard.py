"""Postcard, serde's compact binary format, driven by dataclass annotations.

A struct is a dataclass whose annotations are wire types (`U64`, `Vec[U32]`, another struct,
an `IntEnum` of unit variants, a `data_enum`); its fields are written in declaration order with
nothing between them. Values are plain Python: int, float, bool, str, bytes, list, tuple, None.

Each struct's encoder and decoder are compiled once, on first use, into Python functions with
the scalar fields inlined; containers call their element type's own `encode` / `decode`.
Decoding takes `(data, offset)` and returns `(value, next_offset)`; every failure is a
`PostcardError` naming the field path and the byte offset.
"""

import bisect
import dataclasses
import enum
import operator
from array import array
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
    "to_plain",
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


def _as_error(exc, data=None):
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


# Varints

_SMALL = 1 << 14
_VARINT = [bytes([v]) if v < 0x80 else bytes([v & 0x7F | 0x80, v >> 7]) for v in range(_SMALL)]
# The first two bytes of every longer varint, by its low 14 bits.
_LOW14 = [bytes([v & 0x7F | 0x80, v >> 7 | 0x80]) for v in range(_SMALL)]


def _write_varint(v, bits):
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


def _varint_reader(bits, start=0):
    """A reader of a `bits`-bit varint at `p` of `d`, returning it and the offset after it: at
    most ceil(bits/7) bytes, the last one holding only the bits that remain.

    With `start`, the reader takes `(d, p, v)`: its first `start` bytes are already read into `v`.
    It is generated unrolled, one step a byte, which costs half what a loop does in Python.
    """
    size = -(-bits // 7)
    last_max = (1 << (bits - 7 * (size - 1))) - 1
    src = ["def read(d, p, v=0):", "    try:"]
    for i in range(start, size):
        src += [f"        b = d[p + {i}]", "        if b < 0x80:"]
        if i == size - 1:
            error = f"PostcardError('varint above the u{bits} range', p)"
            src.append(f"            if b > {last_max}: raise {error}")
        src += [f"            return v | b << {7 * i}, p + {i + 1}", f"        v |= (b & 0x7F) << {7 * i}"]
    src += [
        "    except IndexError:",
        "        raise _eof(len(d)) from None",
        f"    raise PostcardError('varint longer than {size} bytes', p)",
    ]
    ns = {"PostcardError": PostcardError, "_eof": _eof}
    exec(compile("\n".join(src), f"<varint u{bits}>", "exec"), ns)
    return ns["read"]


def _read_len(d, p):
    """A length prefix (a `usize`, written as a u64 varint)."""
    if p < len(d) and d[p] < 0x80:
        return d[p], p + 1
    return U64.decode(d, p)


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
    type: writing local `x` to bytearray `out`, or reading local `to` from bytes `d` at offset `p`
    and advancing `p`. `ref(obj)` names `obj` in the compiled code's namespace. The default calls
    the type's own `encode` / `decode`.
    """

    name = "?"

    def zero(self):
        raise NotImplementedError

    def encode(self, v, out):
        raise NotImplementedError

    def decode(self, d, p):
        raise NotImplementedError

    def value_of(self, d):
        """The value at the start of `d`."""
        return self.decode(d, 0)[0]

    def enc_src(self, ref):
        return [f"{ref(self.encode)}(x, out)"]

    def dec_src(self, ref, to):
        return [f"{to}, p = {ref(self.decode)}(d, p)"]

    def __repr__(self):
        return self.name


class _Varint(WireType):
    def __init__(self, bits):
        self.name = f"u{bits}"
        self.bits = bits
        self.read = _varint_reader(bits)
        self.read_rest = _varint_reader(bits, 3) if bits > 21 else None

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

    def dec_src(self, ref, to):
        """One- and two-byte varints inline, and three-byte ones unless that is the last byte
        (where `- 0x4080` drops the two continuation bits)."""
        src = [
            f"{to} = d[p]",
            f"if {to} < 0x80:",
            "    p += 1",
            "else:",
            "    b1 = d[p + 1]",
            "    if b1 < 0x80:",
            f"        {to} = {to} & 0x7F | b1 << 7",
            "        p += 2",
        ]
        if self.bits <= 21:
            return src + ["    else:", f"        {to}, p = {ref(self.read)}(d, p)"]
        return src + [
            "    elif (b2 := d[p + 2]) < 0x80:",
            f"        {to} += (b1 << 7) + (b2 << 14) - 0x4080",
            "        p += 3",
            "    else:",
            f"        {to} = {to} & 0x7F | (b1 & 0x7F) << 7 | (b2 & 0x7F) << 14",
            f"        {to}, p = {ref(self.read_rest)}(d, p, {to})",
        ]


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

    def dec_src(self, ref, to):
        return [f"{to} = d[p]", "p += 1"]


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

    def dec_src(self, ref, to):
        return [f"{to} = _check_bool(d[p], p)", "p += 1"]


_F32 = Struct("<f")


class _F32Type(WireType):
    name = "f32"

    def zero(self):
        return 0.0

    def encode(self, v, out):
        out += _F32.pack(v)

    def decode(self, d, p):
        if len(d) - p < 4:
            raise _eof(len(d))
        return _F32.unpack_from(d, p)[0], p + 4

    def enc_src(self, ref):
        return ["out += _F32.pack(x)"]

    def dec_src(self, ref, to):
        return [f"{to} = _F32.unpack_from(d, p)[0]", "p += 4"]


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
            raise _eof(len(d))
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


def _array_code(bits):
    """The `array` type code of unsigned ints of `bits` bits."""
    return next(code for code in "BHILQ" if array(code).itemsize * 8 == bits)


# Varints of the values seen in token lists, up to this many: at most a vocabulary's worth.
_VARINT_CACHE_MAX = 1 << 18


class _VarintVec(_VecType):
    """`Vec<u16|u32|u64>`, token lists above all.

    Writing checks the whole list at once with `array` and joins cached varints in C; reading
    handles the short varints inline. Any sequence of ints is written, bytes included.
    """

    def __init__(self, elem):
        super().__init__(elem)
        self.code = _array_code(elem.bits)
        self.cache = dict(enumerate(_VARINT))

    def encode(self, v, out):
        n = len(v)
        out += _VARINT[n] if n < _SMALL else _write_varint(n, 64)
        try:
            array(self.code, v)
        except (TypeError, ValueError, OverflowError):
            self._check_elements(v)
        try:
            out += b"".join(map(self.cache.__getitem__, v))
        except KeyError:
            out += self._encode_uncached(v)

    def _encode_uncached(self, v):
        cache, write = self.cache, self.elem.write
        for x in v:
            if x not in cache and len(cache) < _VARINT_CACHE_MAX:
                cache[x] = write(x)
        return b"".join([cache.get(x) or write(x) for x in v])

    def _check_elements(self, v):
        """Raises for the first element out of range, where `array` took `v` as a whole amiss."""
        for i, x in enumerate(v):
            try:
                self.elem.write(x)
            except PostcardError as e:
                raise e.within(f"[{i}]") from None

    def decode(self, d, p):
        n, p = _read_len(d, p)
        if n > len(d) - p:
            raise PostcardError(f"{n} elements cannot fit in the {len(d) - p} bytes left", p)
        run = d[p : p + n]
        if run.isascii():
            return list(run), p + n
        read, read_rest = self.elem.read, self.elem.read_rest
        out = [0] * n
        i = 0
        try:
            for i in range(n):
                b = d[p]
                if b < 0x80:
                    p += 1
                else:
                    b1 = d[p + 1]
                    if b1 < 0x80:
                        b = b & 0x7F | b1 << 7
                        p += 2
                    elif not read_rest:
                        b, p = read(d, p)
                    elif (b2 := d[p + 2]) < 0x80:
                        b += (b1 << 7) + (b2 << 14) - 0x4080
                        p += 3
                    else:
                        b, p = read_rest(d, p, b & 0x7F | (b1 & 0x7F) << 7 | (b2 & 0x7F) << 14)
                out[i] = b
        except IndexError:
            raise _eof(len(d)).within(f"[{i}]") from None
        except PostcardError as e:
            raise e.within(f"[{i}]") from None
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
    writes exactly as the wrapped value. An error's path goes on with the variant's fields.
    """

    def __init__(self, cls):
        self.cls = cls
        self.name = cls.__name__
        self.variants = cls._variants
        self.structs = [_struct_of(v) for v in self.variants]
        self.writers = None

    def zero(self):
        return self.variants[0]()

    def _writers(self):
        """Each variant's index bytes and field encoder, by its class (made on first use, as
        the variants compile then)."""
        if self.writers is None:
            self.writers = {
                v: (_VARINT[i], s.compiled_encode())
                for i, (v, s) in enumerate(zip(self.variants, self.structs))
            }
        return self.writers

    def encode(self, v, out):
        found = self._writers().get(type(v))
        if found is None:
            raise PostcardError(f"expected a {self.name} variant, got {type(v).__name__}")
        out += found[0]
        found[1](v, out)

    def decode(self, d, p):
        i, q = U32.decode(d, p)
        if i >= len(self.structs):
            raise PostcardError(f"unknown {self.name} variant {i}", p)
        return self.structs[i].decode(d, q)

    def enc_src(self, ref):
        return [
            f"w = {ref(self._writers())}.get(type(x))",
            "if w is None:",
            f"    {ref(self.encode)}(x, out)",
            "else:",
            "    out += w[0]",
            "    w[1](x, out)",
        ]

    def dec_src(self, ref, to):
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

    def __init__(self, cls):
        self.cls = cls
        self.name = cls.__name__
        self.compiled = False

    def zero(self):
        return self.cls()

    def encode(self, v, out):
        self._compile()
        self.encode(v, out)

    def decode(self, d, p):
        self._compile()
        return self.decode(d, p)

    def value_of(self, d):
        self._compile()
        return self.value_of(d)

    def enc_src(self, ref):
        return [f"{ref(self.compiled_encode())}(x, out)"]

    def dec_src(self, ref, to):
        return [f"{to}, p = {ref(self.compiled_decode())}(d, p)"]

    def compiled_encode(self):
        self._compile()
        return self.encode

    def compiled_decode(self):
        self._compile()
        return self.decode

    def _compile(self):
        """Replaces `encode`, `decode` and `value_of` on this instance with compiled functions.

        Threads racing here each compile and set the same functions; `compiled` is set last, so
        none can find it set before the functions are.
        """
        if self.compiled:
            return
        fields = [(f.name, wire_type(f.type)) for f in dataclasses.fields(self.cls)]
        ns = {
            "_VARINT": _VARINT,
            "_F32": _F32,
            "_check_bool": _check_bool,
            "_write_bool": _write_bool,
            "_as_error": _as_error,
            "_field_at": _field_at,
            "_ENCODE_ERRORS": _ENCODE_ERRORS,
            "_DECODE_ERRORS": _DECODE_ERRORS,
            "NEW": self.cls,
            "_new": object.__new__,
        }

        def ref(obj):
            name = f"_r{len(ns)}"
            ns[name] = obj
            return name

        source = _struct_source(fields, ref, _assigns_only(self.cls))
        exec(compile(source, f"<postcard {self.name}>", "exec"), ns)
        self.encode, self.decode, self.value_of = ns["encode"], ns["decode"], ns["value_of"]
        self.compiled = True


def _struct_source(fields, ref, assign):
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
    body, body_starts = [], []
    for i, (name, t) in enumerate(fields):
        enc_starts.append(len(enc) + 1)
        enc += [f"        x = v.{name}"] + ["        " + line for line in t.enc_src(ref)]
        body_starts.append(len(body))
        body += ["        " + line for line in t.dec_src(ref, f"x{i}")]
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


def _assigns_only(cls):
    """Whether `cls(*fields)` does nothing but set its fields, which a decoder can do itself
    faster: so for a `struct` with the dataclass `__init__` and no `__post_init__`."""
    return cls.__dict__.get("_assigns_only", False)


def _field_at(exc, starts):
    """The index of the field whose lines (starting at `starts`) `exc` came through."""
    return bisect.bisect_right(starts, exc.__traceback__.tb_lineno) - 1


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
    `data_enum` (for which each variant's class stands too)."""
    t = _TYPES.get(annotation)
    if t is not None:
        return t
    if isinstance(annotation, WireType):
        return annotation
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
    cls._assigns_only = "__init__" not in cls.__dict__ and not hasattr(cls, "__post_init__")
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
    try:
        t = _TYPES[cls]  # wire_type's lookup inlined: this is the hot path
    except KeyError:
        t = wire_type(cls)
    if type(data) is not bytes:
        try:
            data = bytes(memoryview(data))
        except TypeError:
            raise PostcardError(f"expected bytes, got {type(data).__name__}").within(t.name) from None
    try:
        return t.value_of(data)
    except PostcardError as e:
        raise e.within(t.name) from None


def to_plain(value):
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
