"""The header of a GGUF file: its metadata and where each tensor lies, read in one pass.

The `gguf` package's reader builds a numpy view for every element of every metadata array and
takes seconds over a 50,000-token vocabulary; the node (before it dequantizes the tensors with
`gguf`) and the client (which wants only the vocabulary and chat template) read the header here
instead. Torch-free, so the client can use it.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
#: Metadata value types: struct formats of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """The file is no GGUF file, or its header is cut short or malformed."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: GGUF name, shape as GGUF lists it (fastest-varying first), ggml type, and
    byte offset from the start of the data section."""

    name: str
    shape: tuple[int, ...]
    type: int
    offset: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict
    tensors: list[TensorInfo]
    #: Where the data section starts in the file.
    data_offset: int


def read_header(path: str | os.PathLike, with_tensors: bool = True) -> GGUFHeader:
    """The header of the GGUF file at `path`; GGUFHeaderError when it is not one."""
    with open(path, "rb") as f:
        fixed = f.read(24)
        if len(fixed) < 24 or fixed[:4] != MAGIC:
            raise GGUFHeaderError(f"{path} is not a GGUF file")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", fixed, 4)
        reader = _Reader(f)
        try:
            metadata = {reader.string(): reader.value(reader.scalar("I")) for _ in range(n_fields)}
            tensors = [reader.tensor_info() for _ in range(n_tensors)] if with_tensors else []
        except (struct.error, UnicodeDecodeError, MemoryError, OverflowError) as e:
            raise GGUFHeaderError(f"{path}: the GGUF header is damaged ({e})") from None
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_offset = -(-f.tell() // alignment) * alignment
    return GGUFHeader(version, metadata, tensors, data_offset)


class _Reader:
    """Little-endian GGUF values from a file, read sequentially."""

    def __init__(self, f: BinaryIO):
        self.f = f

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack("<" + fmt, self._read(size))[0]

    def string(self) -> str:
        return self._read(self.scalar("Q")).decode("utf-8")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.scalar("I"), self.scalar("Q")
            if item in _SCALARS:
                fmt = _SCALARS[item]
                return list(struct.unpack(f"<{n}{fmt}", self._read(n * struct.calcsize(fmt))))
            return [self.value(item) for _ in range(n)]
        raise struct.error(f"metadata value type {kind} is unknown")

    def tensor_info(self) -> TensorInfo:
        name = self.string()
        dims = self.scalar("I")
        shape = tuple(self.scalar("Q") for _ in range(dims))
        return TensorInfo(name, shape, self.scalar("I"), self.scalar("Q"))

    def _read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise struct.error("the file ends inside its header")
        return data
