"""What the command line may ask of the engines, kept apart from them so that reading it
imports no engine (and no torch)."""

import enum

RUNTIMES = ("mock", "torch")
#: `--dtype` and `--kv-dtype` choices for the torch engine. The model's auto is bf16 on CUDA and
#: fp32 on CPU; the KV pool's is fp16 where the node's CPU kernels attend, else the model's.
DTYPES = ("auto", "float32", "bfloat16", "float16")


class WeightFormat(enum.StrEnum):
    """`--weights`: how the torch engine holds its projections (see engine/quant.py)."""

    AUTO = "auto"
    FLOAT = "float"
    INT8 = "int8"
    INT4 = "int4"


WEIGHTS = tuple(WeightFormat)
#: `--engine-stall-timeout-ms`: a step running longer than this while work waits marks the torch
#: engine stalled. Far above any healthy step (a full prefill chunk of a 7B model on a CPU takes
#: seconds), well within what a supervisor's liveness probe waits.
DEFAULT_STALL_TIMEOUT_MS = 30_000
