"""What the command line may ask of the engines, kept apart from them so that reading it
imports no engine (and no torch)."""

RUNTIMES = ("mock", "torch")
#: `--dtype` choices for the torch engine; auto is bf16 on CUDA and fp32 on CPU.
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: `--weights` choices: how the torch engine holds its projections (see engine/quant.py).
WEIGHTS = ("auto", "float", "int8", "int4")
