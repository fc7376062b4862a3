"""Torch engine speed, and the same weights in Hugging Face `transformers`, side by side.

For the builtin model and for a Llama-layout checkpoint written to a temp dir, prints:
prefill tokens/s; decode tokens/s at 1 lane and aggregate at 8 lanes (target ≥ 4× the 1-lane
rate); `LlamaForCausalLM.generate` (greedy, KV cache on) decode tokens/s on the same weights
(target: ours / theirs ≥ 1.0); the largest logit difference over a prompt (target ≤ 1e-4); and
whether the greedy tokens agree. Decode rates are (N - 1) / (T(N) - T(1)) for both engines,
T(n) the wall time of a whole n-token generation, so prefill and set-up cancel out.
Then, on the builtin model:
- prefix reuse: a 4-turn chat of about 2,000 tokens, each turn's prompt the last prompt, its
  reply and a new message; time to first token per turn with the prefix cache on and off
  (target: from turn 2 on, on ≥ 5× faster than off);
- idle memory: the resident set of a serving `superfluid-noded --model builtin` against a bare
  `import torch` process (target: ≤ bare + 1.2 × the weights' bytes + 32 MB).
Exits 1 when a target is missed.

Run: .venv/bin/python -m pip install transformers && .venv/bin/python tests/bench/engine.py
(or name sections: `engine.py memory chat`; `speed` is the comparison with transformers)
"""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from procstat import rss_mb  # noqa: E402

from nodeagent.daemon import GenExtras  # noqa: E402
from nodeagent.engine.builtin import BUILTIN_CONFIG, BUILTIN_SEED, builtin_model, random_tensors  # noqa: E402
from nodeagent.engine.checkpoint import write_checkpoint  # noqa: E402
from nodeagent.engine.model import ModelConfig  # noqa: E402
from nodeagent.engine.torch_engine import TorchDaemon  # noqa: E402
from proto.params import GenParams  # noqa: E402

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
    fresh = itertools.count(1)  # a new prompt each time, so the prefix cache cannot answer it
    prefill = PREFILL_TOKENS / best_time(lambda: ours.generate(prompt(PREFILL_TOKENS, next(fresh)), 1))
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


CHAT_TURNS = (1400, 120, 120, 120)  # message lengths; with 64-token replies, ~2,000 tokens
CHAT_REPLY = 64
TTFT_TARGET = 5.0
RSS_WEIGHT_FACTOR, RSS_SLACK_MB = 1.2, 32


def arrived(arrivals: list[float], batch: list[int]) -> bool:
    arrivals.append(time.perf_counter())
    return True


def chat_ttft(prefix_cache: bool) -> list[float]:
    """Seconds to the first token of each turn of the chat, one session on a fresh engine."""
    daemon = TorchDaemon(
        builtin_model(torch.float32, torch.device("cpu")), "builtin", max_batch=1, prefix_cache=prefix_cache
    )
    context: list[int] = []
    ttfts = []
    for turn, length in enumerate(CHAT_TURNS):
        context += prompt(length, salt=1000 * turn)
        arrivals: list[float] = []
        started = time.perf_counter()
        result = daemon.generate_tokens_streaming(
            context, GenParams(), CHAT_REPLY, 0, GenExtras(), functools.partial(arrived, arrivals)
        )
        ttfts.append(arrivals[0] - started)
        context += result.tokens
    daemon.close()
    return ttfts


def chat() -> list[str]:
    """Each mode twice on fresh engines, the better time per turn (the first token of one turn
    is a single measurement, so one slow moment on a shared machine would decide it)."""
    runs = {cache: [chat_ttft(cache) for _ in range(2)] for cache in (True, False)}
    on, off = ([min(turn) for turn in zip(*runs[cache], strict=True)] for cache in (True, False))
    ratios = [b / a for a, b in zip(on, off, strict=True)]
    total = sum(CHAT_TURNS) + CHAT_REPLY * (len(CHAT_TURNS) - 1)
    print(f"\n== prefix reuse: a {len(CHAT_TURNS)}-turn chat of ~{total} tokens on builtin, time to first token")
    print("  turn   cache on    cache off    off / on")
    for turn, (a, b, r) in enumerate(zip(on, off, ratios, strict=True), 1):
        print(f"  {turn:4}   {a * 1e3:7.1f} ms  {b * 1e3:8.1f} ms   {r:6.1f}×")
    worst = min(ratios[1:])
    print(f"  from turn 2 on, at least {worst:.1f}× faster   (target ≥ {TTFT_TARGET:.0f})")
    return [] if worst >= TTFT_TARGET else [f"prefix reuse: TTFT from turn 2 ≥ {TTFT_TARGET:.0f}× cache off"]


def idle_rss_mb(argv: list[str], ready: str) -> float:
    """Resident MB of the process `argv` once `ready` is in a line of its stderr and it has sat
    a second."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        for line in proc.stderr:
            if ready in line:
                break
        time.sleep(1.0)
        return rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)


def bare_torch_rss_mb() -> float:
    code = "import sys, time, torch; print('ready', file=sys.stderr, flush=True); time.sleep(600)"
    return idle_rss_mb([sys.executable, "-c", code], "ready")


def idle_node_rss_mb(model: str) -> float:
    """A node serving `model` on loopback, once its serving line is out."""
    return idle_rss_mb([sys.executable, "-m", "nodeagent", "--model", model, "--listen", "127.0.0.1:0"], "serving")


def memory() -> list[str]:
    bare, node = bare_torch_rss_mb(), idle_node_rss_mb("builtin")
    weights_mb = sum(t.numel() for t in random_tensors(BUILTIN_CONFIG, BUILTIN_SEED).values()) * 4 / 2**20
    limit = bare + RSS_WEIGHT_FACTOR * weights_mb + RSS_SLACK_MB
    print("\n== idle memory of superfluid-noded --model builtin (fp32, 256 MB KV budget)")
    print(f"  bare `import torch`                {bare:7.0f} MB")
    print(f"  weights                            {weights_mb:7.0f} MB")
    rule = f"bare + {RSS_WEIGHT_FACTOR} × weights + {RSS_SLACK_MB}"
    print(f"  serving, idle                      {node:7.0f} MB   (target ≤ {limit:.0f} = {rule})")
    return [] if node <= limit else ["idle RSS of --model builtin within bare torch + 1.2 × weights + 32 MB"]


def speed() -> list[str]:
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
    return missed


SECTIONS = {"speed": speed, "chat": chat, "memory": memory}


def main() -> int:
    torch.set_num_threads(2)
    started = time.perf_counter()
    missed = []
    for name in sys.argv[1:] or SECTIONS:
        missed += SECTIONS[name]()
    print(f"\nbench took {time.perf_counter() - started:.0f} s")
    for name in missed:
        print(f"MISSED: {name}")
    print("all targets met" if not missed else f"{len(missed)} target(s) missed")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
