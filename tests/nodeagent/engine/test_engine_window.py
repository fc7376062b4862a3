"""Which checkpoints get a sliding window, read from config.json as Hugging Face reads it (the
window's maths is checked against the reference in test_engine_parity)."""

from __future__ import annotations

import pytest

from nodeagent.daemon import ModelLoadError
from nodeagent.engine.loader import config_from_hf

BASE = {"vocab_size": 32, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2}


@pytest.mark.parametrize(
    "extra,window",
    [
        ({"model_type": "mistral", "sliding_window": 4096}, 4096),
        ({"model_type": "mistral", "sliding_window": None}, None),
        ({"model_type": "mistral"}, None),
        ({"model_type": "llama", "sliding_window": 4096}, None),
        ({"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False}, None),
        ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 0}, 64),
        ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 4}, None),
        ({"model_type": "mistral", "sliding_window": 64, "layer_types": ["sliding_attention"] * 4}, 64),
    ],
)
def test_the_window_comes_from_the_config_as_hugging_face_reads_it(extra, window):
    assert config_from_hf({**BASE, **extra}).sliding_window == window


@pytest.mark.parametrize(
    "extra",
    [
        {"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2},
        {"model_type": "mistral", "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"] * 2},
    ],
)
def test_a_window_on_some_layers_only_is_refused(extra):
    with pytest.raises(ModelLoadError, match="sliding window on some layers only"):
        config_from_hf({**BASE, **extra})
