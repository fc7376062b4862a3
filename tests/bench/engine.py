"""Torch engine speed, and the same weights in Hugging Face `transformers`, side by side.

For the builtin model and for a Llama-layout checkpoint written to a temp dir, prints:
prefill tokens/s; decode tokens/s at 1 lane and aggregate at 8 lanes (target ≥ 4× the 1-lane
rate); `LlamaForCausalLM.generate` (greedy, KV cache on) decode tokens/s on the same weights
(target: ours / theirs ≥ 1.0); the largest logit difference over a prompt (target ≤ 1e-4); and
whether the greedy tokens agree. Decode rates are (N - 1) / (T(N) - T(1)) for both engines,
T(n) the wall time of a whole n-token generation, so prefill and set-up cancel out.
Exits 1 when a target is missed.

Run: .venv/bin/python -m pip install transformers && .venv/bin/python tests/bench/engine.py
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nodeagent.daemon import GenExtras  # noqa: E402
from nodeagent.engine.builtin import BUILTIN_CONFIG, BUILTIN_SEED, random_tensors  # noqa: E402
from nodeagent.engine.checkpoint import write_checkpoint  # noqa: E402
from nodeagent.engine.model import ModelConfig  # noqa: E402
from nodeagent.engine.torch_engine import TorchDaemon  # noqa: E402
from nodeagent.wal import GenParams  # noqa: E402

NEW_TOKENS = 128
PREFILL_TOKENS = 512
LANES = 8
REPEATS = 3
CHECKPOINT_CONFIG = ModelConfig(
    vocab_size=32000,
    hidden_size=384,
    intermediate_size=1024,
    n_layers=6,
    n_heads=6,
    n_kv_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def prompt(length: int, salt: int = 0) -> list[int]:
    return [(17 + 7919 * (i + salt)) % 31000 + 100 for i in range(length)]


def best_time(fn) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def decode_rate(timed) -> float:
    """(N - 1) tokens over T(N) - T(1): the decode steps alone."""
    return (NEW_TOKENS - 1) / (best_time(lambda: timed(NEW_TOKENS)) - best_time(lambda: timed(1)))


class Ours:
    def __init__(self, directory: Path):
        self.daemon = TorchDaemon.load(str(directory), device="cpu", max_batch=LANES)

    def generate(self, tokens: list[int], n: int) -> list[int]:
        result = self.daemon.generate_tokens_streaming(tokens, GenParams(), n, 0, GenExtras(), lambda b: True)
        return result.tokens

    def lanes(self, n: int) -> None:
        threads = [threading.Thread(target=self.generate, args=(prompt(16, i), n)) for i in range(LANES)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def logits(self, tokens: list[int]) -> torch.Tensor:
        model = self.daemon.model
        with torch.inference_mode():
            x = model.run_causal(model.embed(torch.tensor([tokens])), 0, model.config.n_layers)
            return model.logits(x[0])


class Theirs:
    def __init__(self, directory: Path):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()

    def generate(self, tokens: list[int], n: int) -> list[int]:
        ids = torch.tensor([tokens])
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        return out[0, len(tokens) :].tolist()

    def logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(torch.tensor([tokens])).logits[0].float()


def bench(label: str, directory: Path) -> list[str]:
    """Print one model's figures; returns the targets it missed."""
    ours, theirs = Ours(directory), Theirs(directory)
    short = prompt(16)
    prefill = PREFILL_TOKENS / best_time(lambda: ours.generate(prompt(PREFILL_TOKENS), 1))
    one_lane = decode_rate(lambda n: ours.generate(short, n))
    eight_lanes = LANES * decode_rate(ours.lanes)
    hf_one_lane = decode_rate(lambda n: theirs.generate(short, n))
    logit_diff = float((ours.logits(prompt(64)) - theirs.logits(prompt(64))).abs().max())
    same_tokens = ours.generate(short, NEW_TOKENS) == theirs.generate(short, NEW_TOKENS)
    ours.daemon.close()

    scale, vs_hf = eight_lanes / one_lane, one_lane / hf_one_lane
    checks = [
        (f"{label}: 8-lane aggregate ≥ 4× 1-lane", scale >= 4.0),
        (f"{label}: 1-lane decode ≥ transformers", vs_hf >= 1.0),
        (f"{label}: logits within 1e-4 of transformers", logit_diff <= 1e-4),
        (f"{label}: greedy tokens equal transformers'", same_tokens),
    ]
    print(f"\n== {label} ({ours.daemon.summary()})")
    print(f"  prefill ({PREFILL_TOKENS}-token prompt)       {prefill:9.1f} tokens/s")
    print(f"  decode, 1 lane                     {one_lane:9.1f} tokens/s")
    print(f"  decode, {LANES} lanes aggregate          {eight_lanes:9.1f} tokens/s   {scale:5.2f}× 1 lane (target ≥ 4)")
    print(f"  transformers generate, 1 lane      {hf_one_lane:9.1f} tokens/s")
    print(f"  ours / transformers, 1 lane        {vs_hf:9.2f}             (target ≥ 1.0)")
    print(f"  max |logit difference|             {logit_diff:9.2e}             (target ≤ 1e-4)")
    print(f"  greedy {NEW_TOKENS} tokens equal            {'yes' if same_tokens else 'NO':>9}")
    return [name for name, ok in checks if not ok]


def main() -> int:
    torch.set_num_threads(2)
    started = time.perf_counter()
    missed = []
    with tempfile.TemporaryDirectory() as tmp:
        builtin_dir = write_checkpoint(
            Path(tmp) / "builtin", BUILTIN_CONFIG, random_tensors(BUILTIN_CONFIG, BUILTIN_SEED)
        )
        missed += bench("builtin", builtin_dir)
        checkpoint_dir = write_checkpoint(
            Path(tmp) / "llama-gqa-34m", CHECKPOINT_CONFIG, random_tensors(CHECKPOINT_CONFIG, 7), shards=3
        )
        missed += bench("llama-gqa-34m checkpoint", checkpoint_dir)
    print(f"\nbench took {time.perf_counter() - started:.0f} s")
    for name in missed:
        print(f"MISSED: {name}")
    print("all targets met" if not missed else f"{len(missed)} target(s) missed")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
