"""GGUF checkpoints (llama.cpp, Ollama): the config from the file's metadata and its tensors
dequantized, renamed and reordered into the Hugging Face layout `LlamaModel.from_source` reads.

The header is read by `nodeagent.gguf_header`, the tensors dequantized by the `gguf` package
(every type it knows); each tensor is copied out of the file's memory map as it is converted,
so once loading ends nothing stays mapped. llama.cpp stores Llama's q/k rows permuted for its
rotary kernel; they are put back in Hugging Face's order here so one code path builds every
model.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import torch

from nodeagent.daemon import ModelLoadError
from nodeagent.engine.choices import WeightFormat
from nodeagent.engine.families import registry
from nodeagent.engine.families.base import (
    GGUF_GLOBAL_NAMES,
    GGUF_LAYER_NAMES,
    Family,
    check_config,
    gguf_rope_scaling,
)
from nodeagent.engine.loader import Progress, checked, refuse_unused
from nodeagent.engine.model import LlamaModel, ModelConfig
from nodeagent.engine.quant import held_format
from nodeagent.engine.shard import Shard, sharded
from nodeagent.gguf_header import GGUFHeader, GGUFHeaderError, TensorInfo, read_header

_LAYER_GGUF = {engine: short for short, engine in GGUF_LAYER_NAMES.items()}
_GLOBAL_GGUF = {engine: short for short, engine in GGUF_GLOBAL_NAMES.items()}
#: Small tensors that hold rope divisors rather than weights (`Family.gguf_rope_factors`).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


#: Bits per weight of the quantized ggml types, by the precision they keep: 4 for the 4-bit and
#: smaller types, 8 for the 5- to 8-bit ones. A float type is absent.
_TYPE_BITS = {
    **dict.fromkeys(("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K"), 4),
    **dict.fromkeys(("IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "TQ1_0", "TQ2_0"), 4),
    **dict.fromkeys(("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"), 8),
}


def load_gguf(
    path: str | os.PathLike,
    dtype: torch.dtype,
    device: torch.device,
    weights: WeightFormat = WeightFormat.FLOAT,
    shard: Shard | None = None,
) -> LlamaModel:
    """Read the GGUF file at `path` (`shard`'s share of it) onto `device`; raises
    ModelLoadError on any problem."""
    source = GGUFSource(Path(path))
    try:
        tensors = source.family.source(source, source.config, hf=False)
        local, reader = sharded(source.config, tensors, shard, Path(path).name)
        model = LlamaModel.from_source(local, reader, dtype, device, weights)
        refuse_unused(str(path), source.names(), source.used, source.config)
        return model
    finally:
        source.close()


def projection_bits(path: str | os.PathLike) -> int | None:
    """The fewest bits per weight a quantized layer matrix of the file keeps (4 or 8), or None
    if every one is float. A file with any 4-bit matrix loads as int4 under auto, each wider
    matrix in int8 (a Gemma 3 Q4_K_M file is mostly Q5_0, which its 1152 columns force)."""
    bits = [b for b in map(type_bits, _layer_types(Path(path))) if b is not None]
    return min(bits, default=None)


def _layer_types(path: Path) -> list[int]:
    """The ggml type of each of the file's layer matrices."""
    return [t.type for t in _read_header(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2]


#: The ggml types whose groups of 32 the engine's formats hold without loss (int4 keeps a
#: Q4_0, Q4_1 or Q4_K group's codes, `quant.grid_steps`; int8 a Q8_0 group's).
_KEPT = {WeightFormat.INT4: ("Q4_0", "Q4_1", "Q4_K"), WeightFormat.INT8: ("Q8_0",)}


def type_conversions(path: str | os.PathLike, fmt: WeightFormat) -> str:
    """What each ggml type of the file's layer matrices became in `fmt`, commonest first, e.g.
    "Q4_K x112 as int4, Q6_K x17 as int8 re-rounded"."""
    from gguf import GGMLQuantizationType

    types = _layer_types(Path(path))
    parts = []
    for ggml_type in sorted(set(types), key=lambda t: -types.count(t)):
        name, count = GGMLQuantizationType(ggml_type).name, types.count(ggml_type)
        held = held_format(fmt, type_bits(ggml_type))
        if held == WeightFormat.FLOAT:
            parts.append(f"{name} x{count} dequantized")
        else:
            parts.append(f"{name} x{count} as {held.value}{'' if name in _KEPT.get(held, ()) else ' re-rounded'}")
    return ", ".join(parts)


def type_bits(ggml_type: int) -> int | None:
    """The bits a ggml tensor type keeps, by `_TYPE_BITS` (None: a float or unknown type)."""
    from gguf import GGMLQuantizationType

    try:
        return _TYPE_BITS.get(GGMLQuantizationType(ggml_type).name)
    except ValueError:
        return None


def _read_header(path: Path) -> GGUFHeader:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    try:
        return read_header(path)
    except GGUFHeaderError as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from None


class GGUFSource:
    """The tensors of one GGUF file under their Hugging Face names, dequantized on demand."""

    def __init__(self, path: Path):
        self.path = path
        header = _read_header(path)
        self._metadata = header.metadata
        self._tensors = {_hf_name(t.name): t for t in header.tensors}
        self._data_offset = header.data_offset
        self._map = np.memmap(path, mode="r")
        self.arch = metadata(self._metadata, "general.architecture", str)
        try:
            self.family = registry.by_architecture(self.arch)
        except ModelLoadError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        self.used: set[str] = set()
        self._progress = Progress(len(self._tensors))
        vectors = {name: tuple(self.get(name, (-1,)).tolist()) for name in ROPE_TENSORS if name in self._tensors}
        self.config = config_from_gguf(self._metadata, self.family, self.arch, self._tensors, vectors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> set[str]:
        return set(self._tensors)

    def bits(self, name: str) -> int | None:
        return type_bits(self._tensors[name].type) if name in self._tensors else None

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path} lacks tensor {gguf_name(name)!r}")
        info = self._tensors[name]
        values = torch.from_numpy(self._dequantized(info))
        values = checked(info.name, values, tuple(values.shape) if shape == (-1,) else shape)
        if self.arch in self.family.permuted_architectures and (".q_proj." in name or ".k_proj." in name):
            heads = self.config.n_heads if ".q_proj." in name else self.config.n_kv_heads
            values = unpermute_rotary_rows(values, heads)
        self.used.add(name)
        self._progress.step()
        return values

    def _dequantized(self, info: TensorInfo) -> np.ndarray:
        """The tensor as float32 [rows, columns] in memory of its own, never a view of the file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        try:
            qtype = GGMLQuantizationType(info.type)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{self.path}: tensor {info.name!r} has unknown type {info.type}") from None
        shape = [int(n) for n in reversed(info.shape)]
        row_bytes = shape[-1] // block * block_bytes
        start = self._data_offset + info.offset
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        # A plain ndarray view: numpy's memmap subclass costs a call on every slice gguf takes.
        raw = self._map[start : start + rows * row_bytes].view(np.ndarray)
        if raw.size != rows * row_bytes:
            raise ModelLoadError(f"{self.path}: tensor {info.name!r} lies past the end of the file")
        try:
            values = dequantize(raw.reshape(rows, row_bytes), qtype)
        except NotImplementedError:
            raise ModelLoadError(
                f"{self.path}: tensor {info.name!r} has type {qtype.name}, which cannot be "
                f"dequantized (supported: the float and quantized types of the gguf package)"
            ) from None
        values = values.reshape(shape).astype(np.float32, copy=False)
        return values.copy() if np.may_share_memory(values, self._map) else values

    def close(self) -> None:
        self._tensors.clear()
        del self._map
        self._progress.done()


def unpermute_rotary_rows(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head it interleaves the two rotary halves,
    (j, j + hd/2) side by side; Hugging Face keeps the halves apart."""
    head_dim = rows.shape[0] // n_heads
    per_head = rows.reshape(n_heads, head_dim // 2, 2, *rows.shape[1:])
    return per_head.transpose(1, 2).reshape(rows.shape).contiguous()


def _hf_name(name: str) -> str:
    """The engine's name for a GGUF tensor name (`families.base`'s names)."""
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{GGUF_LAYER_NAMES[rest]}"
    return GGUF_GLOBAL_NAMES.get(name, name)


def gguf_name(hf_name: str) -> str:
    """The GGUF name of a Hugging Face tensor name (for messages and the writer)."""
    if hf_name.startswith("model.layers."):
        layer, rest = hf_name[len("model.layers.") :].split(".", 1)
        if rest in _LAYER_GGUF:
            return f"blk.{layer}.{_LAYER_GGUF[rest]}"
    return _GLOBAL_GGUF.get(hf_name, hf_name)


def metadata(fields: dict, key: str, kind: type, default=None):
    """One metadata value, checked for its type; ModelLoadError when required and absent."""
    if key not in fields:
        if default is None:
            raise ModelLoadError(f"GGUF metadata lacks {key}")
        return default
    value = fields[key]
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise ModelLoadError(f"GGUF metadata {key} is {value!r}, not {kind.__name__}")
    return value


def config_from_gguf(fields: dict, family: Family, arch: str, tensors: dict,
                     vectors: dict[str, tuple[float, ...]]) -> ModelConfig:
    """The engine's config from `{arch}.*` metadata, the family's maths read by the family;
    tied output when there is no output.weight. `vectors`: the file's rope tensors."""

    def get(key: str, kind: type, default=None):
        return metadata(fields, f"{arch}.{key}", kind, default)

    if get("expert_count", int, 0) > 0:
        raise ModelLoadError(f"GGUF {arch} with experts (a mixture of experts) is not a decoder this engine runs; "
                             f"it runs: {registry.supported()}")
    hidden = get("embedding_length", int)
    n_heads = get("attention.head_count", int)
    head_dim = get("attention.key_length", int, hidden // n_heads)
    if get("attention.value_length", int, head_dim) != head_dim:
        raise ModelLoadError(f"GGUF {arch}: key and value head sizes differ")
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise ModelLoadError("GGUF file lacks tensor 'token_embd.weight'")
    factors = family.gguf_rope_factors(get, vectors)
    config = ModelConfig(
        vocab_size=int(embed.shape[-1]),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length", int),
        n_layers=get("block_count", int),
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", int, n_heads),
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", float, 1e-6),
        rope_theta=get("rope.freq_base", float, 10000.0),
        rope_scaling=None if factors is not None else gguf_rope_scaling(get),
        rope_factors=factors,
        max_position_embeddings=get("context_length", int, 2048),
        tie_word_embeddings="lm_head.weight" not in tensors,
        eos_token_ids=_end_tokens(fields),
        sliding_window=get("attention.sliding_window", int, 0) or None,
    )
    config = dataclasses.replace(config, spec=family.spec_from_gguf(get, config, tensors))
    if get("rope.dimension_count", int, head_dim) != config.rotary_dim:
        raise ModelLoadError(f"GGUF {arch}: rope.dimension_count differs from the rotary share of a head")
    check_config(config, f"GGUF {arch}")
    return config


def _end_tokens(fields: dict) -> tuple[int, ...]:
    """End of text and end of turn: a chat model stops at either."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return tuple(sorted({metadata(fields, key, int) for key in keys if key in fields}))
