"""Tensor parallelism across processes, on torch.distributed (gloo on the CPU, NCCL on CUDA).

The node's process is rank 0: the agent, the scheduler and the KV bookkeeping. It starts one
worker process for each other rank; each loads its own shard (`engine/shard.py`) and a KV pool
of the same blocks for its share of the KV heads, then follows rank 0: for every step rank 0
broadcasts the step's `Batch` (tokens, counts, starts, block table), every rank runs it on its
shard with an all-reduce after o and down, and rank 0 alone reads the logits and samples. A
stage forward goes the same way, as the hidden state after the embedding. All of rank 0's
collectives come from the scheduler thread, so the ranks meet them in one order.

A worker that dies fails the engine (every generation ends with an error, the node exits);
rank 0 going away ends the workers, whose next collective fails.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from enum import IntEnum
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nodeagent.daemon import ModelLoadError
from nodeagent.engine.cpu_kernels import CpuKernels
from nodeagent.engine.kvpool import BLOCK_TOKENS, KVPool, blocks_for
from nodeagent.engine.model import LlamaModel
from nodeagent.engine.scheduler import Batch, attention_kernels, forward_batch

log = logging.getLogger(__name__)

#: How long a worker may take to load its shard and join the group.
START_TIMEOUT_S = 600.0
#: How long a collective may wait for a rank that neither answers nor hangs up.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
#: How often rank 0 looks at its workers.
WATCH_PERIOD_S = 0.2
#: A step's header: its kind, then the sizes of what follows.
HEADER = 5


class Step(IntEnum):
    FORWARD = 1
    STAGE = 2
    STOP = 3


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """What a worker needs to load its shard as rank 0 loaded its own."""

    model: str
    dtype: str
    weights: str
    device: str
    world: int
    threads: int | None
    port: int
    fast_prefill: bool = False

    def device_of(self, rank: int) -> torch.device:
        return torch.device(f"cuda:{rank}") if self.device == "cuda" else torch.device("cpu")

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


#: Loads rank `rank`'s shard of `spec.model`; torch_engine provides it (the loaders live there).
LoadShard = Callable[[ShardSpec, int], LlamaModel]


class TensorParallel:
    """Rank 0's side: the workers, and the broadcast of each step to them."""

    def __init__(
        self, spec: ShardSpec, workers: list[BaseProcess], pipes: list[multiprocessing.connection.Connection]
    ) -> None:
        self.spec = spec
        self.workers = workers
        self.pipes = pipes
        self.device = spec.device_of(0)
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    @classmethod
    def launch(cls, spec: ShardSpec, load_shard: LoadShard) -> TensorParallel:
        """Starts the workers, which load their shards while rank 0 loads its own."""
        context = mp.get_context("spawn")
        workers: list[BaseProcess] = []
        pipes = []
        for rank in range(1, spec.world):
            ours, theirs = context.Pipe()
            worker = context.Process(
                target=follow, args=(spec, rank, load_shard, theirs), name=f"superfluid-tp-rank{rank}", daemon=True
            )
            worker.start()
            workers.append(worker)
            pipes.append(ours)
        return cls(spec, workers, pipes)

    def form(self, model: LlamaModel, kv_blocks: int, context: int) -> None:
        """Once every worker has loaded: gives each its KV pool's size and dtype (`model.kv_dtype`)
        and the context window, forms the group and makes `model` (rank 0's) sum its partial
        outputs across it.
        ModelLoadError naming the rank and its device when one could not load."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, pipe in enumerate(self.pipes, start=1):
            self._loaded(rank, pipe, deadline)
            pipe.send((kv_blocks, context, model.kv_dtype))
        _join_group(self.spec, 0)
        model.reduce = all_reduce

    def _loaded(self, rank: int, pipe: multiprocessing.connection.Connection, deadline: float) -> None:
        where = f"tensor-parallel rank {rank} ({self.spec.device_of(rank)})"
        worker = self.workers[rank - 1]
        while not pipe.poll(0.1):
            if not worker.is_alive():
                raise ModelLoadError(f"{where} exited with {worker.exitcode} while loading its shard")
            if time.monotonic() > deadline:
                raise ModelLoadError(f"{where} did not load its shard within {START_TIMEOUT_S:g} s")
        try:
            status, detail = pipe.recv()
        except EOFError:
            worker.join(1.0)
            raise ModelLoadError(f"{where} exited with {worker.exitcode} while loading its shard") from None
        if status != "loaded":
            raise ModelLoadError(f"{where} could not load its shard: {detail}")

    def send_forward(self, batch: Batch) -> None:
        b, w = batch.tokens.shape
        _send_header(Step.FORWARD, b, w, batch.blocks.shape[1], len(batch.fresh), self.device)
        flat = torch.cat(
            [batch.tokens.reshape(-1), batch.counts, batch.starts, batch.blocks.reshape(-1), batch.fresh]
        )
        dist.broadcast(flat, 0)

    def send_stage(self, hidden: torch.Tensor, start: int, end: int) -> None:
        """`hidden` [1,N,D]: the stage's input, which every rank runs layers [start, end) on."""
        _send_header(Step.STAGE, hidden.shape[1], start, end, 0, self.device)
        dist.broadcast(hidden.contiguous(), 0)

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """From now on a worker that exits calls `on_failure` with what happened."""
        self._watcher = threading.Thread(target=self._watch, args=(on_failure,), name="tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self, on_failure: Callable[[str], None]) -> None:
        while not self._closing.wait(WATCH_PERIOD_S):
            for rank, worker in enumerate(self.workers, start=1):
                if not worker.is_alive():
                    on_failure(
                        f"tensor-parallel rank {rank} ({self.spec.device_of(rank)}) exited with {worker.exitcode}"
                    )
                    return

    def close(self, healthy: bool = True, timeout: float = 5.0) -> None:
        """Stops the workers (told to by a STOP step while the group works, else killed) and the
        thread watching them."""
        self._closing.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        if not healthy:
            timeout = 0.0
        if healthy and all(w.is_alive() for w in self.workers) and dist.is_initialized():
            try:
                _send_header(Step.STOP, 0, 0, 0, 0, self.device)
            except RuntimeError:
                pass
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join(1.0)
        if healthy and dist.is_initialized():
            dist.destroy_process_group()


def all_reduce(partial: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `partial`, in place."""
    dist.all_reduce(partial)
    return partial


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(spec: ShardSpec, rank: int) -> None:
    dist.init_process_group(
        spec.backend,
        init_method=f"tcp://127.0.0.1:{spec.port}",
        rank=rank,
        world_size=spec.world,
        timeout=COLLECTIVE_TIMEOUT,
    )


def _send_header(step: Step, a: int, b: int, c: int, e: int, device: torch.device) -> None:
    dist.broadcast(torch.tensor([step, a, b, c, e], dtype=torch.long, device=device), 0)


# ---- a worker ----------------------------------------------------------------------------------


def follow(spec: ShardSpec, rank: int, load_shard: LoadShard, pipe: multiprocessing.connection.Connection) -> None:
    """A worker process: loads rank `rank`'s shard, joins the group, then runs every step rank
    0 sends until it says stop or goes away."""
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if spec.device == "cuda":
        torch.cuda.set_device(rank)
    try:
        model = load_shard(spec, rank)
    except Exception as e:  # noqa: BLE001 - told to rank 0, which names this rank in its refusal
        pipe.send(("failed", f"{type(e).__name__}: {e}"))
        return
    pipe.send(("loaded", model.weight_bytes()))
    kv_blocks, context, model.kv_dtype = pipe.recv()
    c = model.config
    model.set_context(context)
    pool = KVPool(c.n_layers, c.n_kv_heads, c.head_dim, kv_blocks, model.kv_dtype, model.device)
    kernels = attention_kernels(model, pool)  # built before the first step, which rank 0 waits on
    _join_group(spec, rank)
    model.reduce = all_reduce
    arange = torch.arange(blocks_for(context) * BLOCK_TOKENS, device=model.device)
    with torch.inference_mode():
        try:
            while _run_step(model, pool, arange, kernels):
                pass
        except RuntimeError as e:  # rank 0 went away mid-collective: nothing to follow
            log.debug(f"tensor-parallel rank {rank} stops: {e}")
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_step(model: LlamaModel, pool: KVPool, arange: torch.Tensor, kernels: CpuKernels | None) -> bool:
    """Receives one step from rank 0 and runs this rank's part; False at STOP."""
    header = torch.empty(HEADER, dtype=torch.long, device=model.device)
    dist.broadcast(header, 0)
    step, a, b, c, e = (int(v) for v in header.tolist())
    if step == Step.FORWARD:
        flat = torch.empty(a * b + 2 * a + a * c + e, dtype=torch.long, device=model.device)
        dist.broadcast(flat, 0)
        tokens, counts, starts, blocks, fresh = flat.split([a * b, a, a, a * c, e])
        if e:
            pool.zero(fresh.tolist())
        batch = Batch(tokens.view(a, b), counts, starts, blocks.view(a, c), fresh)
        forward_batch(model, pool, arange, batch, kernels)
    elif step == Step.STAGE:
        hidden = torch.empty(1, a, model.config.hidden_size, dtype=model.dtype, device=model.device)
        dist.broadcast(hidden, 0)
        model.run_causal(hidden, b, c)
    return step != Step.STOP
