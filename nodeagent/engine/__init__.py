"""Engines a node can serve from, chosen by `--engine`/`--runtime`."""

from __future__ import annotations

from nodeagent.daemon import Daemon
from nodeagent.engine.choices import DEFAULT_STALL_TIMEOUT_MS, RUNTIMES
from nodeagent.failpoints import Failpoints


def open_engine(
    runtime: str,
    model: str | None,
    *,
    device: str = "auto",
    max_batch: int = 8,
    max_context: int | None = None,
    kv_budget_mb: int | None = None,
    token_delay_s: float = 0.0,
    dtype: str = "auto",
    kv_dtype: str = "auto",
    weights: str = "auto",
    fast_prefill: bool = False,
    threads: int | None = None,
    stall_timeout_ms: int = DEFAULT_STALL_TIMEOUT_MS,
    faults: Failpoints | None = None,
    tensor_parallel: int = 1,
) -> Daemon:
    """Build the daemon for `runtime`; imports torch only when the torch engine is asked for.

    `token_delay_s` slows the mock's every step, so tests can hold a generation open. The
    stall timeout, the failpoints, the KV dtype, fast prefill and tensor parallelism are the
    torch engine's: the mock has no scheduler thread, no KV pool and no layers to split.
    """
    if runtime == "mock":
        from nodeagent.engine.mock import MOCK_WINDOW, MockDaemon

        if tensor_parallel > 1:
            raise ValueError("tensor parallelism needs the torch runtime; the mock has no layers to split")

        return MockDaemon(
            max_context=max_context or MOCK_WINDOW, max_lanes=max_batch, token_delay_s=token_delay_s
        )
    if runtime == "torch":
        from nodeagent.engine.torch_engine import TorchDaemon

        return TorchDaemon.load(
            model or "builtin",
            device=device,
            max_batch=max_batch,
            max_context=max_context,
            kv_budget_mb=kv_budget_mb,
            dtype=dtype,
            kv_dtype=kv_dtype,
            weights=weights,
            fast_prefill=fast_prefill,
            threads=threads,
            stall_timeout_ms=stall_timeout_ms,
            faults=faults,
            tensor_parallel=tensor_parallel,
        )
    raise ValueError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")
