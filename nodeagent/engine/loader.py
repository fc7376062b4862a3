"""Hugging Face checkpoint directories: `config.json` and `*.safetensors`, sharded or not.

Every failure becomes a ModelLoadError that names the file, key or tensor at fault, since the
operator sees only that line before the node exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from nodeagent.daemon import ModelLoadError
from nodeagent.engine.choices import WeightFormat
from nodeagent.engine.families import registry
from nodeagent.engine.families.base import ids
from nodeagent.engine.model import LlamaModel, ModelConfig
from nodeagent.engine.shard import Shard, sharded

INDEX_FILE = "model.safetensors.index.json"
#: Tensors a checkpoint may carry that change nothing: rotary tables the model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype,
    device: torch.device,
    weights: WeightFormat = WeightFormat.FLOAT,
    shard: Shard | None = None,
) -> LlamaModel:
    """Read the checkpoint at `path` (`shard`'s share of it) onto `device`; raises
    ModelLoadError on any problem."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {str(directory)!r} does not exist")
    raw = _read_json(directory / "config.json")
    family = registry.by_model_type(raw.get("model_type", "llama"))
    config = family.config_from_hf(raw, _generation_eos(directory))
    source = SafetensorsSource(directory)
    try:
        local, reader = sharded(config, family.source(source, config, hf=True), shard, directory.name)
        model = LlamaModel.from_source(local, reader, dtype, device, weights)
        refuse_unused(str(directory), source.names(), source.used, config)
        return model
    finally:
        source.close()


def read_config(directory: Path) -> ModelConfig:
    """The shape of the checkpoint in `directory`, from its config.json alone."""
    return config_from_hf(_read_json(directory / "config.json"), _generation_eos(directory))


def refuse_unused(where: str, names: set[str], used: set[str], config: ModelConfig) -> None:
    """A tensor the model never read (an MLP bias, a norm this decoder lacks) means the
    checkpoint computes something else: refuse it rather than serve wrong outputs."""
    unused = {n for n in names - used if not n.endswith(IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        unused.discard("lm_head.weight")
    if unused:
        shown = sorted(unused)
        listed = ", ".join(shown[:4]) + (", ..." if len(shown) > 4 else "")
        raise ModelLoadError(f"{where}: tensors this engine does not use: {listed}")


def config_from_hf(raw: dict, extra_eos: tuple[int, ...] = ()) -> ModelConfig:
    """The engine's config from a Hugging Face `config.json`, read by its family."""
    return registry.by_model_type(raw.get("model_type", "llama")).config_from_hf(raw, extra_eos)


def _generation_eos(directory: Path) -> tuple[int, ...]:
    """End tokens from `generation_config.json`, which chat checkpoints often widen."""
    path = directory / "generation_config.json"
    if not path.exists():
        return ()
    return tuple(ids(_read_json(path).get("eos_token_id")))


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return value


def checked(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`tensor`, once its shape is the one the config implies."""
    if tuple(tensor.shape) != tuple(shape):
        raise ModelLoadError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")
    return tensor


class SafetensorsSource:
    """The tensors of a checkpoint directory, opened lazily and read one by one."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._where = self._tensor_files(directory)
        self._open: dict[str, object] = {}
        self._progress = Progress(len(self._where))
        self.used: set[str] = set()

    @staticmethod
    def _tensor_files(directory: Path) -> dict[str, str]:
        index = directory / INDEX_FILE
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index} has no weight_map")
            return {str(k): str(v) for k, v in weight_map.items()}
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no *.safetensors files in {directory}")
        where = {}
        for file in files:
            for name in _open_file(file).keys():
                where[name] = file.name
        return where

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> set[str]:
        return set(self._where)

    def bits(self, name: str) -> int | None:
        return None

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor in memory of its own: safetensors hands out views of the file's map,
        which would keep the whole file mapped for as long as the model lives."""
        if name not in self._where:
            raise ModelLoadError(f"checkpoint {self.directory} lacks tensor {name!r}")
        handle = self._handle(self._where[name])
        try:
            tensor = handle.get_tensor(name).clone()
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise ModelLoadError(f"tensor {name!r} in {self._where[name]} cannot be read: {e}") from None
        self._progress.step()
        self.used.add(name)
        return checked(name, tensor, shape)

    def _handle(self, file: str):
        if file not in self._open:
            self._open[file] = _open_file(self.directory / file)
        return self._open[file]

    def close(self) -> None:
        self._open.clear()
        self._progress.done()


def _open_file(path: Path):
    if not path.exists():
        raise ModelLoadError(f"checkpoint file {path} is missing")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # a truncated or foreign file
        raise ModelLoadError(f"checkpoint file {path} cannot be read: {e}") from None


class Progress:
    """Loading progress on stderr, shown only once loading has taken more than a moment."""

    QUIET_FOR_S = 1.0
    EVERY_S = 0.5

    def __init__(self, total: int):
        self.total = total
        self.count = 0
        self.started = time.monotonic()
        self.last_shown = 0.0
        self.shown = False

    def step(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.started < self.QUIET_FOR_S or now - self.last_shown < self.EVERY_S:
            return
        self.last_shown, self.shown = now, True
        percent = 100 * self.count // max(self.total, 1)
        print(f"superfluid-noded: loading model: {percent}% ({self.count}/{self.total} tensors)",
              file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.shown:
            elapsed = time.monotonic() - self.started
            print(f"superfluid-noded: loaded {self.count} tensors in {elapsed:.1f} s",
                  file=sys.stderr, flush=True)
