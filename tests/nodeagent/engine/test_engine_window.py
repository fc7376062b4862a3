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
        ({"model_type": "qwen3", "sliding_window": 4096, "use_sliding_window": False}, None),
    ],
)
def test_the_window_comes_from_the_config_as_hugging_face_reads_it(extra, window):
    config = config_from_hf({**BASE, **extra})
    assert [config.window(i) for i in range(4)] == [window] * 4


@pytest.mark.parametrize(
    "extra,windows",
    [
        ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2},
         [None, None, 64, 64]),
        ({"model_type": "mistral", "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"] * 2},
         [64, None, 64, None]),
        ({"model_type": "gemma2", "sliding_window": 64, "head_dim": 4}, [64, None, 64, None]),
        ({"model_type": "gemma3_text", "sliding_window": 64, "head_dim": 4, "num_hidden_layers": 7},
         [64, 64, 64, 64, 64, None, 64]),
    ],
)
def test_a_window_on_some_layers_is_read_per_layer(extra, windows):
    config = config_from_hf({**BASE, **extra})
    assert [config.window(i) for i in range(config.n_layers)] == windows
    assert not config.spec.plain()


def test_layer_types_of_the_wrong_length_are_refused():
    with pytest.raises(ModelLoadError, match="layer_types lists 2 layers, not 4"):
        config_from_hf({**BASE, "model_type": "mistral", "sliding_window": 64, "layer_types": ["sliding_attention"] * 2})
