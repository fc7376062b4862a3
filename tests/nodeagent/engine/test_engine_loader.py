"""Hugging Face checkpoints the test writes itself: good ones load and generate, damaged ones
fail with a ModelLoadError that names the problem."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from tinymodel import TINY

from proto import finish
from nodeagent.daemon import GenExtras, ModelLoadError
from nodeagent.engine import loader, open_engine
from nodeagent.engine.builtin import DictSource, random_tensors
from nodeagent.engine.checkpoint import write_checkpoint
from nodeagent.engine.model import LlamaModel
from nodeagent.engine.rope import inv_frequencies
from nodeagent.engine.torch_engine import TorchDaemon
from proto.params import GenParams

#: The tiny model with a rope_theta other than the default, so a loader that dropped it from
#: config.json would generate other tokens, and a window of 1024, so the context tests can ask
#: for 600 within the checkpoint's window.
CHECKPOINT = dataclasses.replace(TINY, rope_theta=500000.0, max_position_embeddings=1024)
PROMPT = [5, 17, 33, 2, 90]


@pytest.fixture(scope="module")
def tensors():
    return random_tensors(CHECKPOINT, seed=3, std=0.1)


def generate(daemon, n=16):
    return daemon.generate_tokens_streaming(PROMPT, GenParams(), n, 0, GenExtras(), lambda b: True)


def in_memory_tokens(config, tensors):
    model = LlamaModel.from_source(config, DictSource(tensors), torch.float32, torch.device("cpu"))
    daemon = TorchDaemon(model, "mem", max_batch=1, kv_blocks=64)
    try:
        return generate(daemon).tokens
    finally:
        daemon.close()


def load(path, **kwargs):
    return TorchDaemon.load(str(path), device="cpu", max_batch=2, kv_budget_mb=2, **kwargs)


def test_sharded_checkpoint_loads_and_generates_like_the_weights_in_memory(tmp_path, tensors):
    directory = write_checkpoint(tmp_path / "tiny-llama", CHECKPOINT, tensors, shards=3)
    assert (directory / "model.safetensors.index.json").exists()
    daemon = load(directory)
    try:
        assert daemon.model_name == "tiny-llama"
        result = generate(daemon)
        assert result.tokens == in_memory_tokens(CHECKPOINT, tensors)
        assert result.finish == finish.LENGTH
        assert "runtime torch (tiny-llama, llama, cpu fp32)" in daemon.summary()
    finally:
        daemon.close()


def test_open_engine_serves_a_single_file_checkpoint(tmp_path, tensors):
    directory = write_checkpoint(tmp_path / "single", CHECKPOINT, tensors)
    daemon = open_engine("torch", str(directory) + "/", device="cpu", max_batch=1, kv_budget_mb=2)
    try:
        assert daemon.model_name == "single"
        assert generate(daemon).tokens == in_memory_tokens(CHECKPOINT, tensors)
    finally:
        daemon.close()


def test_eos_from_a_list_ends_with_finish_eos(tmp_path, tensors):
    free_run = in_memory_tokens(CHECKPOINT, tensors)
    stop = free_run[3]
    config = dataclasses.replace(CHECKPOINT, eos_token_ids=(127, stop))
    daemon = load(write_checkpoint(tmp_path / "eos", config, tensors))
    try:
        result = generate(daemon)
        assert result.finish == finish.EOS
        assert result.tokens == free_run[: free_run.index(stop)]
    finally:
        daemon.close()


def test_generation_config_widens_the_end_tokens(tmp_path, tensors):
    directory = write_checkpoint(tmp_path / "genconf", CHECKPOINT, tensors)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 9]}))
    config = loader.config_from_hf(json.loads((directory / "config.json").read_text()), (1, 9))
    assert set(config.eos_token_ids) == {1, 9}
    assert loader.load_model(directory, torch.float32, torch.device("cpu")).config.eos_token_ids == (1, 9)


def test_context_window_follows_the_checkpoint_and_the_budget(tmp_path, tensors):
    directory = write_checkpoint(tmp_path / "ctx", CHECKPOINT, tensors)
    roomy = load(directory)
    asked = load(directory, max_context=600)
    try:
        assert roomy.max_stream_tokens() == CHECKPOINT.max_position_embeddings
        assert asked.max_stream_tokens() == 600
    finally:
        roomy.close()
        asked.close()


def test_a_window_past_the_checkpoint_s_is_served_at_its_size_and_said(tmp_path, tensors, caplog):
    directory = write_checkpoint(tmp_path / "wide", CHECKPOINT, tensors)
    daemon = load(directory, max_context=CHECKPOINT.max_position_embeddings * 4)
    try:
        assert daemon.max_stream_tokens() == CHECKPOINT.max_position_embeddings
        assert f"is past the model's {CHECKPOINT.max_position_embeddings} tokens" in caplog.text
    finally:
        daemon.close()


def test_a_kv_budget_below_one_window_grows_the_pool_to_one_and_says_so(tmp_path, tensors, caplog):
    """One generation must always fit the pool: a smaller one would leave it queued forever."""
    directory = write_checkpoint(tmp_path / "small-pool", CHECKPOINT, tensors)
    daemon = TorchDaemon.load(str(directory), device="cpu", max_batch=2, kv_budget_mb=0, max_context=1024)
    try:
        window_blocks = -(-daemon.max_stream_tokens() // 16)
        assert daemon.sched_stats().pool_blocks_total == window_blocks
        assert f"the pool grows to {window_blocks} blocks" in caplog.text
    finally:
        daemon.close()


@pytest.mark.parametrize(
    "damage,message",
    [
        ("missing_tensor", "model.layers.1.mlp.up_proj.weight"),
        ("wrong_shape", "shape [64, 63], expected [64, 64]"),
        ("bad_json", "config.json is not valid JSON"),
        ("missing_key", "config.json lacks hidden_size"),
        ("unknown_rope", "unsupported rope_scaling type 'ntk-by-parts'"),
        ("foreign_model", "model_type 'gemma' is not a decoder this engine runs"),
        ("missing_shard", "model-00002-of-00002.safetensors is missing"),
        ("truncated_file", "cannot be read"),
        ("no_weights", "no *.safetensors files"),
        ("gelu", "hidden_act 'gelu' is not supported"),
        ("mlp_bias", "mlp_bias true is not supported"),
        ("stray_bias", "tensors this engine does not use: model.layers.0.mlp.down_proj.bias"),
    ],
)
def test_damaged_checkpoint_fails_naming_the_problem(tmp_path, tensors, damage, message):
    directory = tmp_path / "damaged"
    broken = dict(tensors)
    if damage == "missing_tensor":
        del broken["model.layers.1.mlp.up_proj.weight"]
    if damage == "wrong_shape":
        broken["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 63)
    if damage == "stray_bias":
        broken["model.layers.0.mlp.down_proj.bias"] = torch.zeros(64)
    write_checkpoint(directory, CHECKPOINT, broken, shards=2)
    config_path = directory / "config.json"
    raw = json.loads(config_path.read_text())
    if damage == "bad_json":
        config_path.write_text(config_path.read_text()[:-20])
    if damage == "missing_key":
        del raw["hidden_size"]
        config_path.write_text(json.dumps(raw))
    if damage == "unknown_rope":
        raw["rope_scaling"] = {"rope_type": "ntk-by-parts", "factor": 4.0}
        config_path.write_text(json.dumps(raw))
    if damage == "foreign_model":
        raw["model_type"] = "gemma"
        config_path.write_text(json.dumps(raw))
    if damage == "gelu":
        raw["hidden_act"] = "gelu"
        config_path.write_text(json.dumps(raw))
    if damage == "mlp_bias":
        raw["mlp_bias"] = True
        config_path.write_text(json.dumps(raw))
    if damage == "missing_shard":
        (directory / "model-00002-of-00002.safetensors").unlink()
    if damage == "truncated_file":
        shard = directory / "model-00001-of-00002.safetensors"
        shard.write_bytes(shard.read_bytes()[:100])
    if damage == "no_weights":
        (directory / "model.safetensors.index.json").unlink()
        for shard in directory.glob("*.safetensors"):
            shard.unlink()
    with pytest.raises(ModelLoadError) as caught:
        load(directory)
    assert message in str(caught.value)


def test_no_checkpoint_file_stays_mapped_once_loaded(tmp_path, tensors):
    """safetensors hands out views of its file map; the loader copies each weight out of it."""
    directory = write_checkpoint(tmp_path / "unmapped", CHECKPOINT, tensors, shards=2)
    model = loader.load_model(directory, torch.float32, torch.device("cpu"))
    with open("/proc/self/maps") as maps:
        assert str(directory) not in maps.read()
    assert model.config.n_layers == CHECKPOINT.n_layers


def test_missing_directory_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nowhere")


def test_unavailable_device_is_a_load_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        TorchDaemon.load("builtin", device="cuda")


def test_llama3_rope_slows_long_wavelengths_only():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain = inv_frequencies(128, 500000.0, None).inv_freq
    scaled = inv_frequencies(128, 500000.0, scaling).inv_freq
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 8192 / 4, wavelen > 8192
    assert torch.equal(scaled[short], plain[short])
    assert torch.allclose(scaled[long], plain[long] / 8)
    middle = ~short & ~long
    assert middle.any()
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()


def test_llama3_checkpoint_loads(tmp_path, tensors):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = dataclasses.replace(CHECKPOINT, rope_scaling=scaling)
    daemon = load(write_checkpoint(tmp_path / "llama3", config, tensors))
    try:
        assert len(generate(daemon).tokens) == 16
    finally:
        daemon.close()


def test_slow_load_shows_progress_on_stderr(tmp_path, tensors, monkeypatch, capsys):
    monkeypatch.setattr(loader.Progress, "QUIET_FOR_S", 0.0)
    monkeypatch.setattr(loader.Progress, "EVERY_S", 0.0)
    directory = write_checkpoint(tmp_path / "slow", CHECKPOINT, tensors, shards=2)
    loader.load_model(directory, torch.float32, torch.device("cpu"))
    err = capsys.readouterr().err
    assert f"loading model: 100% ({len(tensors)}/{len(tensors)} tensors)" in err
    assert f"loaded {len(tensors)} tensors in" in err
