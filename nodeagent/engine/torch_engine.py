"""`TorchDaemon`: the Daemon interface over a Llama-family model, a KV pool and a scheduler.

The caller's thread validates, submits a `Generation`, then blocks reading its queue and calls
`on_tokens` itself, so a slow callback never holds up the batch. A caller whose consumer takes
batches without blocking (`Consumer.post`) gets its tokens from the scheduler thread directly
and its thread only waits for the end: one thread hop less per token and lane. Stage forwards
need no cache and read only the weights, so they run on the caller's thread too, alongside the
scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from nodeagent.daemon import (
    MIN_CONTEXT,
    QOS_CLASSES,
    Daemon,
    DeviceMemory,
    EngineFault,
    EngineHealth,
    GenerationError,
    GenerationResult,
    GenExtras,
    ModelLoadError,
    OnTokens,
    SchedStats,
    StageError,
    StageHidden,
    StageOutput,
    StageToken,
    check_stream,
)
from nodeagent.engine.builtin import BUILTIN_CONFIG, BUILTIN_NAME, builtin_model
from nodeagent.engine.choices import DEFAULT_STALL_TIMEOUT_MS, DTYPES, WEIGHTS, WeightFormat
from nodeagent.engine.cpu_kernels import attending_kernels
from nodeagent.engine.gguf_file import GGUFSource, load_gguf, projection_bits, type_conversions
from nodeagent.engine.kvpool import BLOCK_TOKENS, KVPool, blocks_for, bytes_per_block
from nodeagent.engine.linear import bound_kernel_caches
from nodeagent.engine.loader import load_model, read_config
from nodeagent.engine.model import LlamaModel, ModelConfig
from nodeagent.engine.quant import Quantization, WeightFormatError, choose_format
from nodeagent.engine.sampling import LaneSampler
from nodeagent.engine.scheduler import ERROR, PREFILL_CHUNK, TOKEN, Generation, Scheduler
from nodeagent.engine.shard import Shard, shard_config
from nodeagent.engine.tensor_parallel import ShardSpec, TensorParallel, free_port
from nodeagent.failpoints import Failpoints
from nodeagent.heap import bound_arenas, return_free_memory
from proto import finish
from proto.models import AliasUnavailable, is_gguf, resolve
from proto.params import GenParams

log = logging.getLogger(__name__)

CPU_KV_BUDGET_MB = 256
CUDA_KV_SHARE = 0.6  # of the device memory still free once the weights are in
#: How often a caller waiting on its generation looks at its cancel event itself. The scheduler
#: ends a cancelled generation at its next iteration, which wakes the caller; this is only the
#: bound for when an iteration runs long (a big prefill chunk), so it can be slow: eight
#: callers polling every 20 ms cost 3 % of a core that the scheduler's own threads wanted.
CANCEL_POLL_S = 0.1


class TorchDaemon(Daemon):
    """The real engine: continuous batching over a paged KV pool."""

    def __init__(
        self,
        model: LlamaModel,
        name: str,
        *,
        max_batch: int = 8,
        max_context: int | None = None,
        kv_blocks: int | None = None,
        kv_dtype: torch.dtype | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        prefix_cache: bool = True,
        quantization: Quantization | None = None,
        threads: int | None = None,
        stall_timeout_ms: int = DEFAULT_STALL_TIMEOUT_MS,
        faults: Failpoints | None = None,
        tensor_parallel: TensorParallel | None = None,
    ):
        """`model` is rank 0's shard when `tensor_parallel` holds the other ranks, which this
        forms into a group once the KV pool's size is known. `kv_dtype` None: `default_kv_dtype`."""
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        model.kv_dtype = kv_dtype if kv_dtype is not None else default_kv_dtype(model)
        self.model = model
        self._name = name
        self.quantization = quantization or Quantization(model.weights, "as built")
        self.max_batch = max_batch
        if kv_blocks is None:
            kv_blocks = _blocks_in(CPU_KV_BUDGET_MB * 2**20, model, model.kv_dtype)
        model_max = model.config.max_position_embeddings
        self.context = _context_window(model_max, max_context, kv_blocks)
        if max_context is not None and max_context > model_max:
            log.warning(f"context window {max_context} is past the model's {model_max} tokens; serving {model_max}")
        if kv_blocks < blocks_for(self.context):
            log.warning(
                f"a KV budget of {kv_blocks} blocks cannot hold one {self.context}-token window; "
                f"the pool grows to {blocks_for(self.context)} blocks"
            )
            kv_blocks = blocks_for(self.context)
        model.set_context(self.context)
        self.tensor_parallel = tensor_parallel
        if tensor_parallel is not None:
            tensor_parallel.form(model, kv_blocks, self.context)
        pool = KVPool(
            model.config.n_layers,
            model.config.n_kv_heads,
            model.config.head_dim,
            kv_blocks,
            model.kv_dtype,
            model.device,
        )
        self._scheduler = Scheduler(
            model, pool, max_batch, self.context, prefill_chunk, prefix_cache, threads,
            stall_timeout_s=stall_timeout_ms / 1000, faults=faults, tensor_parallel=tensor_parallel,
        )
        if tensor_parallel is not None:
            tensor_parallel.watch(self._scheduler.fail)

    @classmethod
    def load(
        cls,
        model: str,
        *,
        device: str = "auto",
        max_batch: int = 8,
        max_context: int | None = None,
        kv_budget_mb: int | None = None,
        dtype: str = "auto",
        kv_dtype: str = "auto",
        weights: str = "auto",
        fast_prefill: bool = False,
        threads: int | None = None,
        stall_timeout_ms: int = DEFAULT_STALL_TIMEOUT_MS,
        faults: Failpoints | None = None,
        tensor_parallel: int = 1,
    ) -> TorchDaemon:
        """Open `model` ("builtin" or a checkpoint directory), split over `tensor_parallel`
        processes when more than 1; raises ModelLoadError."""
        bound_kernel_caches()
        bound_arenas()
        dev = _resolve_device(device)
        floats = _resolve_dtype(dtype, dev)
        group: TensorParallel | None = None
        try:
            path, name = _resolve_model(model)
            if weights not in WEIGHTS:
                raise ModelLoadError(f"unknown weights format {weights!r}; expected one of {', '.join(WEIGHTS)}")
            quantization = choose_format(WeightFormat(weights), dev, _file_bits(path))
            if tensor_parallel > 1:
                shard_config(_model_config(path), tensor_parallel, name)  # refused before any worker starts
                threads = max(1, (threads or torch.get_num_threads()) // tensor_parallel)
                spec = ShardSpec(
                    path, str(floats).removeprefix("torch."), quantization.format.value, dev.type,
                    tensor_parallel, threads, free_port(), fast_prefill,
                )
                group = TensorParallel.launch(spec, load_shard)
            shard = Shard(0, tensor_parallel) if group is not None else None
            loaded = _load_weights(path, floats, dev, quantization.format, shard)
            if is_gguf(path):
                conversions = type_conversions(path, quantization.format)
                quantization = dataclasses.replace(quantization, reason=f"{quantization.reason}; {conversions}")
            quantization = _with_cpu_kernels(loaded, quantization)
            if fast_prefill:
                quantization = _unpack_prefill(loaded, quantization)
            return_free_memory()
            kv = _resolve_kv_dtype(kv_dtype, loaded)
            blocks = _blocks_in(_kv_budget_bytes(kv_budget_mb, dev), loaded, kv)
            return cls(
                loaded, name, max_batch=max_batch, max_context=max_context, kv_blocks=blocks, kv_dtype=kv,
                quantization=quantization, threads=threads, stall_timeout_ms=stall_timeout_ms, faults=faults,
                tensor_parallel=group,
            )
        except BaseException as e:
            if group is not None:
                group.close(healthy=False)
            if isinstance(e, WeightFormatError):
                raise ModelLoadError(str(e)) from None
            if isinstance(e, (ModelLoadError, KeyboardInterrupt)):
                raise
            raise ModelLoadError(f"cannot load model {model!r}: {e}") from e

    # -- generations ---------------------------------------------------------------------------

    def generate_tokens_streaming(
        self,
        stream: Sequence[int],
        params: GenParams,
        max_tokens: int,
        deadline_ms: int,
        extras: GenExtras,
        on_tokens: OnTokens,
    ) -> GenerationResult:
        started = time.monotonic()
        stream = list(stream)
        self._check_stream(stream)
        if max_tokens <= 0:
            return GenerationResult([], finish.LENGTH)
        deadline = started + deadline_ms / 1000 if deadline_ms > 0 else None
        gen = Generation(
            stream,
            budget=min(max_tokens, self.context - len(stream) + 1),
            deadline=deadline,
            qos=min(max(extras.qos_class, 0), QOS_CLASSES - 1),
            sampler=LaneSampler(params, self.model.device),
            consumer=extras.consumer,
            stop=extras.cancel,
        )
        self._scheduler.submit(gen)
        try:
            return _follow(gen, on_tokens, extras)
        finally:
            self._scheduler.cancel(gen)

    def _check_stream(self, stream: list[int]) -> None:
        check_stream(stream, self.context)
        vocab = self.model.config.vocab_size
        if min(stream) < 0 or max(stream) >= vocab:
            raise GenerationError(f"the stream holds a token outside the vocabulary of {vocab}")

    # -- stage forwards ------------------------------------------------------------------------

    def forward_stage(
        self, tokens: Sequence[int], start_layer: int, end_layer: int, hidden_in: bytes | None
    ) -> StageOutput:
        n_layers = self.model.config.n_layers
        if not 0 <= start_layer <= end_layer <= n_layers:
            raise StageError(
                f"layer range [{start_layer}, {end_layer}) is not within the model's {n_layers} layers"
            )
        if self.tensor_parallel is not None:
            return self._scheduler.call(lambda: self._stage(tokens, start_layer, end_layer, hidden_in))
        with torch.inference_mode():
            return self._stage(tokens, start_layer, end_layer, hidden_in)

    def _stage(self, tokens: Sequence[int], start: int, end: int, hidden_in: bytes | None) -> StageOutput:
        """Layers [start, end) on the stage's input; under tensor parallelism, on the scheduler
        thread, with every rank."""
        x = self._stage_input(tokens, start, hidden_in)
        if self.tensor_parallel is not None:
            self.tensor_parallel.send_stage(x, start, end)
        x = self.model.run_causal(x, start, end)
        if end == self.model.config.n_layers:
            return StageToken(int(self.model.logits(x[0, -1], greedy=True).argmax()))
        return StageHidden(x[0].float().cpu().numpy().astype("<f4").tobytes())

    def _stage_input(self, tokens: Sequence[int], start: int, hidden_in: bytes | None) -> torch.Tensor:
        """The stage's input hidden state [1,N,D]: embedded tokens, or decoded wire bytes."""
        hidden = self.model.config.hidden_size
        if hidden_in is not None:
            row_bytes = 4 * hidden
            if not hidden_in or len(hidden_in) % row_bytes:
                raise StageError(
                    f"hidden state of {len(hidden_in)} bytes is not a whole number of "
                    f"{row_bytes}-byte rows (float32 x {hidden})"
                )
            self._check_positions(len(hidden_in) // row_bytes)
            rows = np.frombuffer(hidden_in, dtype="<f4").reshape(1, -1, hidden)
            return torch.from_numpy(rows.copy()).to(dtype=self.model.dtype, device=self.model.device)
        if not tokens:
            raise StageError("stage forward with neither tokens nor a hidden state")
        if start != 0:
            raise StageError(f"a stage starting at layer {start} needs the previous stage's hidden state")
        self._check_positions(len(tokens))
        vocab = self.model.config.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise StageError(f"stage tokens must lie in 0..{vocab - 1}")
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.model.device)
        return self.model.embed(ids)

    def _check_positions(self, n: int) -> None:
        if n > self.context:
            raise StageError(f"stage input of {n} positions exceeds the context window of {self.context}")

    # -- the rest of the interface -------------------------------------------------------------

    def max_stream_tokens(self) -> int:
        return self.context

    def sched_stats(self) -> SchedStats:
        return self._scheduler.stats()

    @property
    def model_name(self) -> str:
        return self._name

    def summary(self) -> str:
        return (
            f"runtime torch ({self._name}, {self.model.config.spec.family}, {self.model.device.type} "
            f"{_short(self.model.dtype)}), context window "
            f"{self.context} tokens, {self.max_batch} lanes, {self._threads()}{self._memory()}"
        )

    def _threads(self) -> str:
        if self.model.device.type != "cpu":
            return ""
        n = self._scheduler.threads or torch.get_num_threads()
        return f"{n} CPU thread{'s' if n > 1 else ''}, "

    def _memory(self) -> str:
        """What the weights and the KV pool take (each rank, under tensor parallelism) and what
        the device has left."""
        pool = self._scheduler.pool
        c = self.model.config
        block = bytes_per_block(c.n_layers, c.n_kv_heads, c.head_dim, self.model.kv_dtype)
        free = _free_bytes(self.model.device)
        ranks = ""
        if self.tensor_parallel is not None:
            layers = self.model.layer_bytes()
            ranks = (
                f"tensor parallel over {self.tensor_parallel.spec.world} ranks "
                f"({self.tensor_parallel.spec.backend}), each holding {_mb(layers)} of the layers "
                f"and {_mb(self.model.weight_bytes() - layers)} replicated; per rank: "
            )
        return (
            ranks + f"weights {_mb(self.model.weight_bytes())} {self.quantization.format} "
            f"({self.quantization.reason}), kv pool {pool.total} blocks of 16 tokens "
            f"({_mb(pool.total * block)} {_short(self.model.kv_dtype)}, taken as used{self._attended()}), "
            + ("free memory unknown" if free is None else f"{_mb(free)} free")
        )

    def _attended(self) -> str:
        kernels = self._scheduler.attention_kernels
        return "" if kernels is None else f", attended in place on the node's {kernels.build.label} kernels"

    def device_memory(self) -> DeviceMemory:
        if self.model.device.type != "cuda":
            return DeviceMemory()
        free, total = torch.cuda.mem_get_info(self.model.device)
        return DeviceMemory(total=total, free=free)

    def health(self) -> EngineHealth:
        return self._scheduler.health()

    def close(self) -> None:
        self._scheduler.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close(healthy=self.health() == EngineHealth.OK)


def _follow(gen: Generation, on_tokens: OnTokens, extras: GenExtras) -> GenerationResult:
    """Hand `gen`'s tokens to `on_tokens` in batches (unless the scheduler hands them to its
    consumer) until it ends, is cancelled or expires."""
    produced: list[int] = []
    while True:
        try:
            message = _next_message(gen, extras)
        except queue.Empty:
            return GenerationResult([], finish.NONE, expired=True)
        if message is None:
            return GenerationResult(_handed(gen, produced), finish.CANCELLED)
        batch, end = _drain(gen.out, message)
        if batch:
            produced.extend(batch)
            if not on_tokens(batch):
                return GenerationResult(produced, finish.CANCELLED)
        if end is not None:
            kind, value = end
            if kind == ERROR:
                raise EngineFault(value)
            return GenerationResult(_handed(gen, produced), value)


def _handed(gen: Generation, produced: list[int]) -> list[int]:
    """The tokens handed over so far: through `on_tokens`, or by the scheduler to the consumer."""
    return produced if gen.consumer is None else gen.tokens[len(gen.stream) :]


def _next_message(gen: Generation, extras: GenExtras) -> tuple | None:
    """`gen`'s next message; None once the caller cancels; queue.Empty past the deadline. With
    a cancel event it waits in slices, so a generation still queued sees the cancel at once."""
    while not extras.cancelled():
        timeout = None if gen.deadline is None else gen.deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise queue.Empty
        if extras.cancel is not None:
            timeout = CANCEL_POLL_S if timeout is None else min(timeout, CANCEL_POLL_S)
        try:
            return gen.out.get(timeout=timeout)
        except queue.Empty:
            continue
    return None


def _drain(out: queue.Queue, first: tuple) -> tuple[list[int], tuple | None]:
    """`first` and every message already waiting: the tokens, and the end message if any."""
    batch: list[int] = []
    message = first
    while True:
        kind, value = message
        if kind != TOKEN:
            return batch, message
        batch.append(value)
        try:
            message = out.get_nowait()
        except queue.Empty:
            return batch, None


def _load_weights(
    path: str, floats: torch.dtype, device: torch.device, weights: WeightFormat, shard: Shard | None
) -> LlamaModel:
    if path == BUILTIN_NAME:
        return builtin_model(floats, device, weights, shard)
    if is_gguf(path):
        return load_gguf(path, floats, device, weights, shard)
    return load_model(path, floats, device, weights, shard)


def _model_config(path: str) -> ModelConfig:
    """The model's shape, read without its weights."""
    if path == BUILTIN_NAME:
        return BUILTIN_CONFIG
    if not is_gguf(path):
        return read_config(Path(path))
    source = GGUFSource(Path(path))
    try:
        return source.config
    finally:
        source.close()


def load_shard(spec: ShardSpec, rank: int) -> LlamaModel:
    """A tensor-parallel worker's model: rank `rank`'s shard, as rank 0 loads its own."""
    dtype, weights = getattr(torch, spec.dtype), WeightFormat(spec.weights)
    model = _load_weights(spec.model, dtype, spec.device_of(rank), weights, Shard(rank, spec.world))
    if spec.fast_prefill:
        model.unpack_prefill()
    return model


def _with_cpu_kernels(model: LlamaModel, quantization: Quantization) -> Quantization:
    """The serving line's reason, naming the node's CPU kernels where the projections run on them."""
    where = model.cpu_kernels()
    if where is None:
        return quantization
    apart = model.config.spec.why_not_plain()
    layers = f", {model.config.spec.family} layers a projection at a time for its {apart}" if apart else ""
    return dataclasses.replace(quantization, reason=f"{quantization.reason}; node kernels on {where}{layers}")


def _unpack_prefill(model: LlamaModel, quantization: Quantization) -> Quantization:
    """--fast-prefill on a loaded model; the serving line's reason says whether it took."""
    if model.unpack_prefill():
        return dataclasses.replace(quantization, reason=f"{quantization.reason}; fast prefill")
    if model.cpu_kernels() is not None:
        log.info("--fast-prefill: nothing to do, the node's CPU kernels already run prefill chunks fast and exactly")
    else:
        log.warning("--fast-prefill: no int4 projection here can run unpacked; prefill stays on the int4 kernel")
    return quantization


def _resolve_model(model: str) -> tuple[str, str]:
    """(path, advertised name) for builtin, an alias, a GGUF file or a checkpoint directory."""
    if model == BUILTIN_NAME:
        return BUILTIN_NAME, BUILTIN_NAME
    try:
        return resolve(model)
    except AliasUnavailable as e:
        raise ModelLoadError(str(e)) from None


def _file_bits(path: str) -> int | None:
    """What a GGUF file keeps its projections in; None for float checkpoints."""
    return projection_bits(path) if is_gguf(path) else None


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.0f} MB"


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _free_bytes(device: torch.device) -> int | None:
    """Memory still free on `device`: the GPU's, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def serving_threads(torch_threads: int, cpus: int) -> int:
    """The scheduler thread's intra-op threads for a node on the CPU: torch's own default (the
    physical cores), within the CPUs this process may use. The connection loops need little
    CPU beside a decode step, and the quantized kernels' steps are bound by memory bandwidth,
    which a second thread on the 2-core machine nearly doubles (docs/performance.md)."""
    return max(1, min(torch_threads, cpus))


def scheduler_threads(device: str, env: Mapping[str, str] = os.environ) -> int | None:
    """The intra-op thread count for the engine of a node on the CPU, `serving_threads`,
    unless the operator set OMP_NUM_THREADS or MKL_NUM_THREADS (then None: torch's own).

    The calling (main) thread is left at one thread, loading included: once a thread has run
    a parallel region with a team of OpenMP workers, parallel regions on any other thread ran
    at half speed, so only the scheduler's thread runs the forward with several."""
    if env.get("OMP_NUM_THREADS") or env.get("MKL_NUM_THREADS") or _resolve_device(device).type != "cpu":
        return None
    n = serving_threads(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    torch.set_num_threads(1)
    return n


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`--dtype`: auto is bf16 on CUDA and fp32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} asked for, but this torch sees no CUDA device")
        dev = torch.device(device)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device!r} asked for, but this torch sees {torch.cuda.device_count()} CUDA "
                "device(s), numbered from 0"
            )
        return dev
    raise ModelLoadError(f"unknown device {device!r}; expected auto, cpu or cuda")


def _kv_budget_bytes(kv_budget_mb: int | None, device: torch.device) -> int:
    if kv_budget_mb is not None:
        return kv_budget_mb * 2**20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_KV_SHARE)
    return CPU_KV_BUDGET_MB * 2**20


def _blocks_in(budget_bytes: int, model: LlamaModel, kv_dtype: torch.dtype) -> int:
    c = model.config
    return max(1, budget_bytes // bytes_per_block(c.n_layers, c.n_kv_heads, c.head_dim, kv_dtype))


def default_kv_dtype(model: LlamaModel) -> torch.dtype:
    """`--kv-dtype auto`: fp16 where the node's CPU kernels attend over it, else the model's
    dtype (SDPA reads the pool as the model computes)."""
    kernels = attending_kernels(model.device, model.dtype, model.config.head_dim, torch.float16)
    return torch.float16 if kernels is not None else model.dtype


def _resolve_kv_dtype(kv_dtype: str, model: LlamaModel) -> torch.dtype:
    if kv_dtype == "auto":
        return default_kv_dtype(model)
    if kv_dtype not in DTYPES:
        raise ModelLoadError(f"unknown KV dtype {kv_dtype!r}; expected one of {', '.join(DTYPES)}")
    return getattr(torch, kv_dtype)


def _context_window(model_max: int, asked: int | None, kv_blocks: int) -> int:
    """`asked`, or the model's window capped by the pool; floored at 512 where the model allows."""
    window = asked if asked is not None else min(model_max, kv_blocks * BLOCK_TOKENS)
    return min(max(window, MIN_CONTEXT), model_max)
