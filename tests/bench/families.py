"""Each family's quantized GGUF files, as llama.cpp's own tools write them, against the same
file dequantized: the top-1 agreement over teacher-forced positions (target ≥ 99 %, issue 56).

For each architecture llama.cpp converts (`tests/families.py`, widened so every projection fits
the node's kernels and the k-quants' 256-weight blocks), transformers writes a random
checkpoint, `convert_hf_to_gguf.py` an F32 GGUF of it and `llama-quantize` the Q8_0 and Q4_K_M
files. Our engine loads each as `--weights auto` would (the row names the format and why), and
as the float engine (every tensor dequantized to fp32); both run the same `POSITIONS` tokens
(the float engine's own greedy continuation of a prompt) and the row gives the share of
positions whose argmax agrees and the largest logit difference. Exits 1 when a target is missed.

Run: .venv/bin/python tests/bench/families.py [NAME ...]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import families  # noqa: E402
from families import CASES, write_case  # noqa: E402
from llamacpp import llama_cpp_tools  # noqa: E402
from llamacpp_tree import convert, write_byte_level_bpe, write_sentencepiece  # noqa: E402

from nodeagent.engine.choices import WeightFormat  # noqa: E402
from nodeagent.engine.gguf_file import load_gguf, projection_bits  # noqa: E402
from nodeagent.engine.model import LlamaModel  # noqa: E402
from nodeagent.engine.quant import choose_format  # noqa: E402

POSITIONS = 256
TARGET = 0.99
TYPES = ("Q8_0", "Q4_K_M")
#: The test shape widened: every width a multiple of 256 (k-quant blocks) and of 64 (the
#: kernels' outputs), head_dim 64.
WIDE = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512}
CPU = torch.device("cpu")


def teacher_forced_logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.logits(model.run_causal(model.embed(torch.tensor([tokens])), 0, model.config.n_layers)[0])


def greedy_tokens(model: LlamaModel, prompt: list[int], total: int) -> list[int]:
    """`prompt` and the model's greedy continuation of it, `total` tokens in all (recomputed
    whole each step: a bench of a few hundred tokens on a small model)."""
    tokens = list(prompt)
    while len(tokens) < total:
        tokens.append(int(teacher_forced_logits(model, tokens)[-1].argmax()))
    return tokens


def quantize(tools: Path, f32: Path, qtype: str) -> Path:
    out = f32.with_name(f"{f32.stem.removesuffix('-f32')}-{qtype}.gguf")
    subprocess.run([str(tools / "llama-quantize"), str(f32), str(out), qtype], check=True, capture_output=True)
    return out


def run(name: str, tools: Path, work: Path) -> list[bool]:
    directory = work / name
    write_case(name, directory)
    (write_byte_level_bpe if name == "olmo2" else write_sentencepiece)(directory, 60)
    f32 = convert(directory, directory / f"{name}-f32.gguf", byte_level=name == "olmo2")
    met = []
    for qtype in TYPES:
        path = quantize(tools, f32, qtype)
        chosen = choose_format(WeightFormat.AUTO, CPU, projection_bits(path))
        ours = load_gguf(path, torch.float32, CPU, chosen.format)
        dequantized = load_gguf(path, torch.float32, CPU)
        tokens = greedy_tokens(dequantized, [1, 5, 17, 33, 2, 90], POSITIONS)
        theirs, mine = teacher_forced_logits(dequantized, tokens), teacher_forced_logits(ours, tokens)
        agree = float((theirs.argmax(-1) == mine.argmax(-1)).float().mean())
        diff = float((theirs - mine).abs().max())
        met.append(agree >= TARGET)
        print(f"{name:8s} {qtype:7s} {chosen.format.value:6s} ({chosen.reason}; {ours.cpu_kernels() or 'torch'})  "
              f"top-1 {agree:6.1%} of {POSITIONS}  max |dlogit| {diff:.3f}  "
              f"{'ok' if agree >= TARGET else 'MISSED'}", flush=True)
    return met


def main() -> int:
    families.SHAPE.update(WIDE)
    names = sys.argv[1:] or [name for name, case in CASES.items() if case.arch]
    tools = llama_cpp_tools()
    with tempfile.TemporaryDirectory() as tmp:
        met = [ok for name in names for ok in run(name, tools, Path(tmp))]
    print(f"families: {sum(met)} of {len(met)} rows at ≥ {TARGET:.0%} top-1 agreement")
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
