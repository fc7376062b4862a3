"""The torch engine on a CUDA device, checked in one run (`make gpu-check`, under 5 minutes).

On the builtin model: bf16 greedy agreement with fp32 over 64 tokens; the KV pool sized from the
device's free memory; prefill and decode tokens/s at 1 and 8 lanes (bf16); with two devices or
more, tensor parallel 2 against 1 (the same greedy tokens, decode tokens/s at each, fp32). Prints one
table and exits 1 when a check fails. Without CUDA it says so and exits 0, so it can sit in any checkout;
`--device cpu` runs the same steps on the CPU (smaller) to check the script itself.
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nodeagent.daemon import GenExtras  # noqa: E402
from nodeagent.engine.torch_engine import TorchDaemon  # noqa: E402
from proto.params import GenParams  # noqa: E402

AGREEMENT_TOKENS = 64
AGREEMENT_PROMPTS = 4
#: Share of positions where bf16's argmax, fed fp32's tokens, is fp32's token.
AGREEMENT_TARGET = 0.95
LANES = 8
SMALL_KV_MB = 1024


@dataclass
class Sizes:
    prefill: int
    decode: int


SIZES = {"cuda": Sizes(prefill=1024, decode=256), "cpu": Sizes(prefill=256, decode=32)}


@dataclass
class Row:
    name: str
    value: str
    target: str = ""
    ok: bool = True


def prompt(length: int, salt: int = 0) -> list[int]:
    return [(17 + 7919 * (i + salt)) % 31000 + 100 for i in range(length)]


def generate(daemon: TorchDaemon, tokens: list[int], n: int) -> list[int]:
    return daemon.generate_tokens_streaming(tokens, GenParams(), n, 0, GenExtras(), lambda b: True).tokens


def in_lanes(daemon: TorchDaemon, lanes: int, length: int, n: int, salt: int = 0) -> float:
    """Seconds for `lanes` concurrent generations of `n` tokens after `length`-token prompts
    (prompts `salt`.. `salt + lanes - 1`: new salts keep the prefix cache out of a figure)."""
    threads = [
        threading.Thread(target=generate, args=(daemon, prompt(length, salt + i), n)) for i in range(lanes)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sync(daemon)
    return time.perf_counter() - started


def sync(daemon: TorchDaemon) -> None:
    if daemon.model.device.type == "cuda":
        torch.cuda.synchronize(daemon.model.device)


def open_daemon(device: str, dtype: str, kv_budget_mb: int | None, tensor_parallel: int = 1) -> TorchDaemon:
    return TorchDaemon.load(
        "builtin", device=device, dtype=dtype, max_batch=LANES, kv_budget_mb=kv_budget_mb,
        tensor_parallel=tensor_parallel,
    )


def agreement(device: str) -> list[Row]:
    """fp32 greedy tokens, then bf16 fed the same tokens: how often its argmax agrees, and how
    many tokens a free-running bf16 generation keeps equal."""
    fp32, bf16 = open_daemon(device, "float32", SMALL_KV_MB), open_daemon(device, "bfloat16", SMALL_KV_MB)
    agreeing, leading = 0, []
    try:
        for salt in range(AGREEMENT_PROMPTS):
            start = prompt(16, salt)
            reference = generate(fp32, start, AGREEMENT_TOKENS)
            agreeing += teacher_forced_agreement(bf16, start, reference)
            free_running = generate(bf16, start, AGREEMENT_TOKENS)
            leading.append(equal_prefix(reference, free_running))
    finally:
        fp32.close()
        bf16.close()
    share = agreeing / (AGREEMENT_PROMPTS * AGREEMENT_TOKENS)
    return [
        Row(
            f"bf16 argmax = fp32 token, {AGREEMENT_TOKENS} tokens x {AGREEMENT_PROMPTS}",
            f"{share:.1%}",
            f">= {AGREEMENT_TARGET:.0%}",
            share >= AGREEMENT_TARGET,
        ),
        Row("bf16 free-running tokens equal to fp32's", ", ".join(map(str, leading))),
    ]


def teacher_forced_agreement(daemon: TorchDaemon, start: list[int], tokens: list[int]) -> int:
    model = daemon.model
    ids = torch.tensor([start + tokens[:-1]], device=model.device)
    with torch.inference_mode():
        x = model.run_causal(model.embed(ids), 0, model.config.n_layers)
        predicted = model.logits(x[0, len(start) - 1 :]).argmax(-1).tolist()
    return sum(p == t for p, t in zip(predicted, tokens, strict=True))


def equal_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def kv_budget(device: str) -> list[Row]:
    """The default pool: on CUDA a share of the memory free once the weights are in (at least
    half of what was free before the load, and no more than it); on CPU the fixed budget."""
    dev = torch.device(device)
    release_cached(dev)
    free_before = free_bytes(dev)
    daemon = open_daemon(device, "auto", None)
    try:
        kv = daemon._scheduler.pool.kv
        pool_blocks, pool_bytes = daemon._scheduler.pool.total, kv.numel() * kv.element_size()
        del kv
        free_after = free_bytes(dev)
        fits = free_before is None or free_before / 2 <= pool_bytes <= free_before
        summary = daemon.summary()
        ran = len(generate(daemon, prompt(32), 8)) == 8
    finally:
        daemon.close()
        del daemon
        release_cached(dev)
    return [
        Row("free memory before load", gib(free_before)),
        Row("KV pool (default budget)", f"{pool_blocks} blocks, {gib(pool_bytes)}", "1/2 to all of free", fits),
        Row("free memory with the pool", gib(free_after)),
        Row("a generation runs on it", "yes" if ran else "NO", "yes", ran),
        Row("summary", summary),
    ]


def throughput(device: str, sizes: Sizes) -> list[Row]:
    daemon = open_daemon(device, "auto", SMALL_KV_MB)
    rows = []
    try:
        generate(daemon, prompt(64), 4)  # warm up kernels and allocator
        for lanes in (1, LANES):
            prefill_s = in_lanes(daemon, lanes, sizes.prefill, 1, salt=1000 * lanes)
            one = in_lanes(daemon, lanes, 16, 1)
            many = in_lanes(daemon, lanes, 16, sizes.decode)
            prefill_rate = lanes * sizes.prefill / prefill_s
            decode_rate = lanes * (sizes.decode - 1) / (many - one)
            rows.append(Row(f"prefill, {lanes} lane(s) x {sizes.prefill} tokens", f"{prefill_rate:,.0f} tok/s"))
            rows.append(Row(f"decode, {lanes} lane(s) aggregate", f"{decode_rate:,.0f} tok/s"))
        rows.append(Row("engine", daemon.summary()))
    finally:
        daemon.close()
    return rows


def tensor_parallel(device: str, sizes: Sizes) -> list[Row]:
    """Tensor parallel 2 against 1 where there are two devices (on the CPU, two processes):
    the same greedy tokens, and decode tokens/s at 1 and 8 lanes for each, all in fp32 so that
    the split's different summation order cannot flip a near-tie as bf16's rounding could."""
    if device.startswith("cuda") and torch.cuda.device_count() < 2:
        return [Row("tensor parallel 2", f"skipped: {torch.cuda.device_count()} CUDA device")]
    tokens, rows = {}, []
    for world in (1, 2):
        daemon = open_daemon(device, "float32", SMALL_KV_MB, tensor_parallel=world)
        try:
            tokens[world] = generate(daemon, prompt(40), sizes.decode)
            for lanes in (1, LANES):
                one = in_lanes(daemon, lanes, 16, 1, salt=10 * world)
                many = in_lanes(daemon, lanes, 16, sizes.decode, salt=10 * world)
                rate = lanes * (sizes.decode - 1) / (many - one)
                rows.append(Row(f"tensor parallel {world}: decode, {lanes} lane(s), fp32", f"{rate:,.0f} tok/s"))
        finally:
            daemon.close()
    same = tokens[1] == tokens[2]
    rows.append(Row("tensor parallel 2: greedy tokens as at 1", "yes" if same else "NO", "yes", same))
    return rows


def release_cached(device: torch.device) -> None:
    """Give memory the closed engines left in torch's caching allocator back to the device, so
    free memory means free."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def gib(n: int | None) -> str:
    return "n/a on cpu" if n is None else f"{n / 2**30:.2f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu, to check the script")
    device = parser.parse_args().device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: skipped, this torch sees no CUDA device (run with --device cpu to try the steps)")
        return 0
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    sizes = SIZES["cuda" if device.startswith("cuda") else "cpu"]
    rows = agreement(device) + kv_budget(device) + throughput(device, sizes) + tensor_parallel(device, sizes)
    print(f"gpu-check on {name}, torch {torch.__version__}")
    width = max(len(r.name) for r in rows)
    for row in rows:
        mark = "" if not row.target else ("  ok" if row.ok else "  FAILED")
        target = f"  (target {row.target})" if row.target else ""
        print(f"  {row.name:<{width}}  {row.value}{target}{mark}")
    failed = [r.name for r in rows if not r.ok]
    verdict = "all checks passed" if not failed else f"FAILED: {', '.join(failed)}"
    print(f"took {time.perf_counter() - started:.0f} s; {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
