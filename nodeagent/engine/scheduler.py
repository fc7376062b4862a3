"""Continuous batching on one thread: every step runs ONE forward for all decoding lanes.

Callers submit a `Generation` and read its `out` queue, or give it a consumer that this thread
hands each token to directly; only this thread touches the lanes, the KV pool and the model's
KV writes. A prompt is prefilled in chunks between decode steps so a long prompt never stalls
the lanes already running.

KV blocks are taken on demand: a generation is admitted with the blocks of its prompt (less
whatever prefix the pool already caches) and takes one more block each 16 tokens. When the pool
runs dry the lowest-priority, latest-admitted lane is preempted, as vLLM does: its blocks go
back (the full ones stay cached), it waits at the front of its QoS queue, and when admitted
again it recomputes its prompt and the tokens it already produced, then goes on; its caller
just sees the tokens come later. A queued generation may also preempt lanes of a lower QoS
class to get its blocks, so the classes order who waits.

Faults stay with the generations they touch. A step that raises fails its own generations
(`EngineFault`: the head gets Finish(ERROR)); one out of memory first preempts lanes and runs
again with fewer. A watchdog thread marks the engine stalled when one iteration outlives the
stall timeout: every generation it holds ends at once, new ones are refused until it returns.
If the thread itself dies, every generation ends and the engine stays failed.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nodeagent import failpoints
from nodeagent.daemon import QOS_CLASSES, Consumer, EngineFault, EngineHealth, SchedStats
from nodeagent.engine.choices import DEFAULT_STALL_TIMEOUT_MS
from nodeagent.engine.cpu_kernels import CpuKernels
from nodeagent.engine.kvpool import BLOCK_TOKENS, KVPool, blocks_for, chain_key
from nodeagent.engine.model import Attend, LlamaModel, grouped_attention
from nodeagent.engine.sampling import LaneSampler, choose_tokens
from nodeagent.failpoints import Action, Failpoints, InjectedFault
from proto import finish

#: Prompt tokens one step prefills at most, across the lanes prefilling in it.
PREFILL_CHUNK = 512

log = logging.getLogger(__name__)

QUEUED, RUNNING, DONE = "queued", "running", "done"
#: `Generation.admitted` before its first admission: after every admitted one.
NOT_ADMITTED = sys.maxsize

#: Messages on `Generation.out`: ("token", id), ("done", finish code), ("error", message); a
#: generation with a consumer gets no "token" messages there, its tokens go to the consumer.
TOKEN, END, ERROR = "token", "done", "error"
#: Tokens a generation's caller may leave untaken before its lane stops decoding: a head that
#: stops reading holds the lane (until its connection is dropped) but no growing memory.
BACKLOG_TOKENS = 256
#: How long the scheduler waits when every running lane is held back by its caller.
IDLE_WAIT_S = 0.005
#: How long a lane stays held back before it goes to a generation waiting for one: taking it
#: costs the held generation a recompute of its whole context when it resumes, which a head
#: that only paused (a busy loop, a slow scrape) should not pay.
HELD_YIELD_S = 0.5
#: How often the watchdog looks at the scheduler (at most; a quarter of a short stall timeout).
WATCH_PERIOD_S = 0.25
#: Decode steps without running out of memory after which the lane cap an out-of-memory step
#: set grows by one lane again.
OOM_CALM_STEPS = 64
#: Schedulers not yet closed. A process that exits with one running closes it first: a
#: scheduler thread the interpreter's exit tore down aborted the process (exit 134).
_RUNNING: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@dataclass(frozen=True)
class Activity:
    """What the scheduler thread is doing, for the watchdog and its log line."""

    kind: str
    lanes: int
    since: float

    def describe(self, now: float) -> str:
        return f"a {self.kind} over {self.lanes} lane(s), running for {now - self.since:.1f} s"


@dataclass(frozen=True)
class Batch:
    """One step's input: each lane's new tokens [B,W] (padded), how many are real [B], the
    position of the first [B], and its block table [B,NB]. Under tensor parallelism rank 0
    sends it to the other ranks, which run the same step on their shards."""

    tokens: torch.Tensor
    counts: torch.Tensor
    starts: torch.Tensor
    blocks: torch.Tensor
    #: Blocks handed out (and zeroed) since the last step: the other ranks zero theirs.
    fresh: torch.Tensor


class Followers(Protocol):
    """The other tensor-parallel ranks: each step rank 0 runs, they run on their shards."""

    def send_forward(self, batch: Batch) -> None: ...


def forward_batch(
    model: LlamaModel, pool: KVPool, arange: torch.Tensor, batch: Batch, kernels: CpuKernels | None
) -> torch.Tensor:
    """Runs `batch` through every layer, writing its K/V into `pool`; the hidden state [B,D] at
    each lane's last token. `arange` is 0, 1, 2, ... on the model's device, long enough;
    `kernels`, `attention_kernels(model, pool)` as the caller took it at load."""
    width, n_blocks = batch.tokens.shape[1], batch.blocks.shape[1]
    positions = batch.starts[:, None] + arange[:width]
    block_index = (positions // BLOCK_TOKENS).clamp(max=n_blocks - 1)
    write = batch.blocks.gather(1, block_index) * BLOCK_TOKENS + positions % BLOCK_TOKENS
    if width > 1:
        valid = arange[:width] < batch.counts[:, None]
        write = write.masked_fill(~valid, pool.scratch_slot)
        positions = positions.masked_fill(~valid, 0)
    x = model.embed(batch.tokens)
    freqs = model.rope(positions)
    stack = model.layer_stack() if kernels is not None else None
    if stack is not None:
        x = stack(x.contiguous(), freqs[0], pool.kv, write.reshape(-1), batch.blocks, batch.starts, batch.counts)
    else:
        attend = paged_attend(model, pool, batch, positions, write.reshape(-1), kernels)
        for layer in range(model.config.n_layers):
            x = model.layer(layer, x, freqs, attend)
    if width == 1:
        return x[:, 0]
    return x[torch.arange(x.shape[0], device=x.device), batch.counts - 1]


def paged_attend(
    model: LlamaModel, pool: KVPool, batch: Batch, positions: torch.Tensor, write: torch.Tensor,
    kernels: CpuKernels | None,
) -> Attend:
    """Attention for `batch`'s step, storing each layer's new K/V at `write` first: on the CPU
    `kernels`, which read the pool in place, where given; else the lanes' blocks copied out for
    SDPA under a mask built from `positions`."""
    if kernels is not None:
        step = model.by_window(
            lambda w: kernels.attention_step(write, batch.blocks, batch.starts, batch.counts, w or 0)
        )

        def attend_in_place(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return step(layer)(pool.kv[layer], q, kv)

        return attend_in_place
    mask = model.by_window(lambda w: model.attention_mask(positions, batch.blocks.shape[1] * BLOCK_TOKENS, w))
    softcap = model.config.spec.attn_softcap

    def attend_copied(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        pool.write(layer, write, kv.reshape(-1, *kv.shape[2:]))
        keys, values = (part.to(q.dtype) for part in pool.read(layer, batch.blocks))
        return grouped_attention(q, keys, values, mask(layer), softcap)

    return attend_copied


def attention_kernels(model: LlamaModel, pool: KVPool) -> CpuKernels | None:
    """The CPU kernels where they attend for `model` over `pool`: an fp32 model on the CPU, an
    fp32 or fp16 pool, a head size they take, a family whose scores they can compute."""
    return model.attention_kernels(pool.kv.dtype)


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA's out-of-memory error, or the CPU allocator's (a plain RuntimeError)."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )


class Generation:
    """One generation: what the caller asked for, and its lane state on the scheduler thread."""

    def __init__(
        self,
        stream: list[int],
        budget: int,
        deadline: float | None,
        qos: int,
        sampler: LaneSampler,
        consumer: Consumer | None = None,
        stop: threading.Event | None = None,
    ):
        self.stream = stream
        self.budget = budget
        self.deadline = deadline
        self.qos = qos
        self.sampler = sampler
        self.consumer = consumer
        #: The caller's cancel event: the scheduler ends the generation once it is set, which
        #: wakes a caller waiting on `out` without it having to poll.
        self.stop = stop
        #: The consumer refused a token: the generation ends as if its caller cancelled it.
        self.refused = False
        #: Since when (monotonic s) its running lane has been held back; None while it moves.
        self.held_since: float | None = None
        #: The watchdog ended it while its step was stalled: the step's tokens are not handed
        #: over should it return, and its lane is freed at the next iteration.
        self.abandoned = False
        self.out: queue.Queue = queue.Queue()
        self.cancelled = False
        self.state = QUEUED
        self.lane = -1
        #: Order of first admission; a preempted generation keeps it, so it is not the first
        #: victim again the moment it resumes.
        self.admitted = NOT_ADMITTED
        #: The stream, then every token produced so far.
        self.tokens = list(stream)
        self.blocks: list[int] = []
        self.n_cached = 0
        #: Prefix-cache keys of the first len(keys) full blocks of `tokens`.
        self.keys: list[bytes] = []
        #: Leading blocks already offered to (or taken from) the prefix cache.
        self.published = 0

    @property
    def produced(self) -> int:
        return len(self.tokens) - len(self.stream)

    @property
    def target(self) -> int:
        """Positions the cache must hold before the next decode step: every token but the last
        produced, which that step feeds (the whole stream before the first token)."""
        return len(self.tokens) - (1 if self.produced else 0)

    @property
    def prefilling(self) -> bool:
        return self.n_cached < self.target

    @property
    def priority(self) -> tuple[int, int]:
        """Smaller runs first and is preempted last: QoS class, then admission order."""
        return (self.qos, self.admitted)

    def key(self, index: int) -> bytes:
        """The prefix-cache key of full block `index` of `tokens`, computed once."""
        while len(self.keys) <= index:
            n = len(self.keys)
            previous = self.keys[-1] if self.keys else b""
            self.keys.append(chain_key(previous, self.tokens[n * BLOCK_TOKENS : (n + 1) * BLOCK_TOKENS]))
        return self.keys[index]

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def stopped(self) -> bool:
        """Its caller set its cancel event or its consumer refused a token; either way the
        caller may still wait on `out` for the end."""
        return self.refused or (self.stop is not None and self.stop.is_set())

    def held_back(self) -> bool:
        """Its caller (or consumer) has left `BACKLOG_TOKENS` tokens (or its bound) untaken:
        decoding more only piles up."""
        if self.consumer is not None:
            return self.consumer.behind()
        return self.out.qsize() >= BACKLOG_TOKENS

    def hand_over(self, token: int) -> None:
        """Passes `token` on: to the consumer, which stops the generation once it refuses, or
        to the caller reading `out`."""
        if self.consumer is None:
            self.out.put((TOKEN, token))
        elif not self.consumer.post([token]):
            self.refused = True


class Scheduler:
    """The batching thread and its bookkeeping."""

    def __init__(
        self,
        model: LlamaModel,
        pool: KVPool,
        max_batch: int,
        max_context: int,
        prefill_chunk: int = PREFILL_CHUNK,
        prefix_cache: bool = True,
        threads: int | None = None,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_MS / 1000,
        faults: Failpoints | None = None,
        tensor_parallel: Followers | None = None,
    ):
        """`stall_timeout_s` 0 runs no watchdog; `faults` are the failpoints to fire;
        `tensor_parallel`, the other ranks each step is sent to."""
        self.model = model
        self.threads = threads
        self.pool = pool
        #: Chosen (and built) here, at load, so a cold compile never runs inside a watched step.
        self.attention_kernels = attention_kernels(model, pool)
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = prefix_cache
        self.eos = frozenset(model.config.eos_token_ids)
        self._positions = torch.arange(blocks_for(max_context) * BLOCK_TOKENS, device=model.device)
        self._lanes: list[Generation | None] = [None] * max_batch
        self._queues: list[collections.deque[Generation]] = [
            collections.deque() for _ in range(QOS_CLASSES)
        ]
        self._cond = threading.Condition()
        self._stopping = False
        self._admissions = itertools.count()
        self.decode_tokens = 0
        self.prefill_tokens = 0
        self.decode_steps = 0
        self.decode_seconds = 0.0
        self.decode_forward_seconds = 0.0
        #: Prompt tokens taken from the prefix cache instead of prefilled.
        self.reused_tokens = 0
        self.preemptions = 0
        self.stall_timeout_s = stall_timeout_s
        self._faults = faults
        self.tensor_parallel = tensor_parallel
        #: What the thread is doing now (None: waiting for work), written under `_cond`.
        self._activity: Activity | None = None
        #: The activity the watchdog found stalled, until it ends.
        self._stall: Activity | None = None
        #: Why the thread died, once it has.
        self._failed: BaseException | None = None
        #: Work `call` hands the thread: each job and where its answer goes.
        self._jobs: collections.deque[tuple[Callable[[], Any], queue.Queue]] = collections.deque()
        #: Lanes the scheduler fills: fewer than `max_batch` for a while after running out of memory.
        self._lane_cap = max_batch
        self._calm_steps = 0
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torch-scheduler", daemon=True)
        self._thread.start()
        self._watchdog: threading.Thread | None = None
        if stall_timeout_s > 0:
            self._watchdog = threading.Thread(target=self._watch, name="torch-watchdog", daemon=True)
            self._watchdog.start()
        _RUNNING.add(self)

    # -- caller threads ------------------------------------------------------------------------

    def submit(self, gen: Generation) -> None:
        """Queues `gen`; EngineFault while the engine is stalled, failed or closed."""
        with self._cond:
            self._refuse_if_down()
            self._queues[gen.qos].append(gen)
            self._cond.notify()

    def call(self, job: Callable[[], Any]) -> Any:
        """Runs `job` on the scheduler thread between two steps; what it returns or raises.
        Under tensor parallelism every collective must come from that one thread, in order."""
        done: queue.Queue = queue.Queue(maxsize=1)
        with self._cond:
            self._refuse_if_down()
            self._jobs.append((job, done))
            self._cond.notify()
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def fail(self, reason: str) -> None:
        """The engine cannot go on (a tensor-parallel rank died): every generation and job ends
        with an error now, whatever the scheduler thread is doing, and new ones are refused."""
        with self._cond:
            if self._failed is not None:
                return
            self._failed = EngineFault(reason)
            running, queued = self._abandon_all(reason)
            self._cond.notify()
        log.critical(f"torch engine: {reason}; ended {running} running and {queued} queued generation(s)")

    def _refuse_if_down(self) -> None:
        if self._failed is not None:
            raise EngineFault(f"the engine failed: {self._failed}")
        if self._stall is not None:
            raise EngineFault("the engine is stalled")
        if self._stopping:
            raise EngineFault("the engine is closed")

    def _abandon_all(self, message: str) -> tuple[int, int]:
        """Under `_cond`, from any thread: every running generation is told `message` and left
        for the scheduler thread to free; every queued one and every job ends. The counts."""
        running = self._running()
        for gen in running:
            gen.abandoned = True
            gen.out.put((ERROR, message))
        queued = [self._queues[q].popleft() for q in range(QOS_CLASSES) for _ in range(len(self._queues[q]))]
        for gen in queued:
            gen.state = DONE
            gen.out.put((ERROR, message))
        while self._jobs:
            self._jobs.popleft()[1].put((False, EngineFault(message)))
        return len(running), len(queued)

    def cancel(self, gen: Generation) -> None:
        """Stop `gen`; a running one frees its lane and blocks at the next step."""
        with self._cond:
            gen.cancelled = True
            if gen.state == QUEUED:
                self._queues[gen.qos].remove(gen)
                gen.state = DONE

    def stats(self) -> SchedStats:
        with self._cond:
            depth = tuple(len(q) for q in self._queues)
        return SchedStats(
            decode_tokens=self.decode_tokens,
            prefill_tokens=self.prefill_tokens,
            decode_steps=self.decode_steps,
            decode_seconds=self.decode_seconds,
            decode_forward_seconds=self.decode_forward_seconds,
            queue_depth=depth,
            lanes_active=sum(g is not None for g in self._lanes),
            pool_blocks_used=self.pool.used,
            pool_blocks_total=self.pool.total,
        )

    def health(self) -> EngineHealth:
        if self._failed is not None:
            return EngineHealth.FAILED
        return EngineHealth.OK if self._stall is None else EngineHealth.STALLED

    def close(self, timeout: float = 10.0) -> None:
        """Stops the threads; a stalled or failed scheduler thread is not waited for."""
        _RUNNING.discard(self)
        self._closing.set()
        with self._cond:
            self._stopping = True
            self._cond.notify()
            stuck = self._stall is not None or self._failed is not None
        self._thread.join(0 if stuck else timeout)
        if self._watchdog is not None:
            # Joined so it never drops the last reference to the model as the interpreter exits:
            # freeing a tensor lets go of the GIL, and retaking it then kills the thread (abort).
            self._watchdog.join(timeout)

    # -- the watchdog thread -------------------------------------------------------------------

    def _watch(self) -> None:
        period = min(WATCH_PERIOD_S, self.stall_timeout_s / 4)
        while not self._closing.wait(period):
            self._check_stall(time.monotonic())

    def _check_stall(self, now: float) -> None:
        """Past the stall timeout, ends every generation the engine holds, with an error."""
        with self._cond:
            activity = self._activity
            if activity is None or self._stall is not None or now - activity.since < self.stall_timeout_s:
                return
            self._stall = activity
            running, queued = self._abandon_all("the engine stalled")
        log.error(
            f"torch engine: stalled: {activity.describe(now)}, past the stall timeout of "
            f"{self.stall_timeout_s:g} s; ended {running} running and {queued} queued "
            "generation(s), refusing new ones until it returns"
        )

    # -- the scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        if self.threads is not None:
            # OpenMP keeps a thread count per calling thread: this sets the forward's own.
            torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                while self._wait_for_work():
                    self._trip(failpoints.SCHEDULER)
                    self._run_jobs()
                    try:
                        self._iteration()
                    except Exception as e:  # a bookkeeping bug must not kill the thread silently
                        log.exception("torch engine: scheduler iteration failed")
                        self._fail_all(self._running(), e)
                    self._settle()
        except BaseException as e:  # noqa: BLE001 - whatever killed the thread, its generations end
            self._die(e)
            return
        self._shut_down()

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._down() and not self._running() and not any(self._queues) and not self._jobs:
                self._cond.wait()
            return not self._down()

    def _down(self) -> bool:
        return self._stopping or self._failed is not None

    def _run_jobs(self) -> None:
        """Runs the jobs `call` queued, each answered with its result or its error."""
        while True:
            with self._cond:
                if not self._jobs:
                    return
                job, done = self._jobs.popleft()
            try:
                done.put((True, job()))
            except Exception as e:  # noqa: BLE001 - handed to the caller, who raises it
                done.put((False, e))

    def _iteration(self) -> None:
        self._begin("scheduling pass", self._running())
        self._sweep()
        self._yield_held_lanes()
        with self._cond:
            self._admit()
        prefill = self._pick_prefill([g for g in self._running() if g.prefilling])
        if prefill:
            self._prefill(prefill)
        decode = [g for g in self._running() if not g.prefilling and g.held_since is None]
        if decode:
            self._decode(decode)
        if not prefill and not decode:
            with self._cond:  # every lane is held back by its caller: wait, do not spin
                self._cond.wait(IDLE_WAIT_S)

    def _begin(self, kind: str, gens: list[Generation]) -> None:
        with self._cond:
            self._activity = Activity(kind, len(gens), time.monotonic())

    def _settle(self) -> None:
        """Ends the iteration's activity; a stalled one has returned after all."""
        with self._cond:
            stall, self._stall, self._activity = self._stall, None, None
        if stall is not None:
            log.warning(
                f"torch engine: recovered: {stall.describe(time.monotonic())} returned; taking generations again"
            )

    def _trip(self, name: str) -> None:
        """Fires the failpoint armed for this pass of point `name`, if any."""
        point = None if self._faults is None else self._faults.hit(name)
        if point is None:
            return
        log.warning(f"torch engine: failpoint {point} fires")
        if point.action == Action.HANG:
            threading.Event().wait()
        elif point.action == Action.SLEEP:
            time.sleep(point.ms / 1000)
        elif point.action == Action.OOM:
            raise torch.OutOfMemoryError(f"failpoint {point}: out of memory")
        else:
            raise InjectedFault(f"failpoint {point}")

    def _die(self, error: BaseException) -> None:
        """The thread is dying: every generation ends with an error, new ones are refused."""
        log.critical(
            f"torch engine: the scheduler thread died ({error}); every generation ends",
            exc_info=not isinstance(error, InjectedFault),
        )
        with self._cond:
            self._failed = error
            self._abandon_all(f"the engine failed: {error}")

    def _running(self) -> list[Generation]:
        return [g for g in self._lanes if g is not None]

    def _sweep(self) -> None:
        """Free the lanes of generations cancelled or past their deadline, and end those whose
        caller set its cancel event, running or queued."""
        now = time.monotonic()
        for gen in self._running():
            if gen.cancelled or gen.abandoned or gen.expired(now):
                self._release(gen)
            elif gen.stopped():
                self._finish(gen, finish.CANCELLED)
        with self._cond:
            for q in self._queues:
                for gen in [g for g in q if g.stopped()]:
                    q.remove(gen)
                    self._end_queued(gen)

    def _yield_held_lanes(self) -> None:
        """Notes which running lanes their caller holds back (`held_since`, which the decode
        step reads too, so each lane's consumer is asked once an iteration), then preempts those
        held back for `HELD_YIELD_S` for generations waiting that could move, the lowest-priority
        first: a head that stops reading keeps its place in the queue (it comes back once it
        reads again) but no lane another head could use."""
        now = time.monotonic()
        for gen in self._running():
            gen.held_since = (gen.held_since or now) if gen.held_back() else None
        with self._cond:
            waiting = sum(not g.held_back() for q in self._queues for g in q)
        short = waiting - len(self._free_lanes())
        if short <= 0:
            return
        held = [g for g in self._running() if g.held_since is not None and now - g.held_since >= HELD_YIELD_S]
        for gen in sorted(held, key=lambda g: g.priority, reverse=True)[:short]:
            gen.held_since = None
            self._preempt(gen)

    def _admit(self) -> None:
        """Start queued generations by QoS class, passing over those held back by their caller;
        a head that cannot get its blocks waits."""
        free_lanes = self._free_lanes()
        for q in self._queues:
            for gen in [g for g in q if not g.held_back()]:
                if not free_lanes or not self._start(gen, free_lanes[0]):
                    return
                q.remove(gen)
                free_lanes.pop(0)

    def _free_lanes(self) -> list[int]:
        """The lanes a generation may take now: the empty ones, within the lane cap."""
        room = max(self._lane_cap - len(self._running()), 0)
        return [i for i, g in enumerate(self._lanes) if g is None][:room]

    def _start(self, gen: Generation, lane: int) -> bool:
        """Give `gen` the lane and the blocks of what it must prefill, reusing cached ones;
        False (nothing taken) when the pool cannot spare them even after preempting lanes of a
        lower class. Each running lane keeps one block of headroom to grow into."""
        reusable = (gen.target - 1) // BLOCK_TOKENS if self.prefix_cache else 0
        cached = self.pool.match([gen.key(i) for i in range(reusable)])
        need = blocks_for(gen.target) - len(cached)
        while need + len(self._running()) > self.pool.available - self.pool.idle_among(cached):
            lower = [g for g in self._running() if g.qos > gen.qos]
            if not lower:
                return False
            self._preempt(max(lower, key=lambda g: g.priority))
        self.pool.hold(cached)  # before allocating, which could otherwise evict them
        try:
            fresh = self._allocate(need)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            fresh = None  # it waits in its queue for the next pass
        if fresh is None:  # cannot happen after the check above; never hold blocks then
            self.pool.release(cached)
            return False
        gen.state, gen.lane = RUNNING, lane
        if gen.admitted == NOT_ADMITTED:
            gen.admitted = next(self._admissions)
        gen.blocks = cached + fresh
        gen.published, gen.n_cached = len(cached), len(cached) * BLOCK_TOKENS
        self.reused_tokens += gen.n_cached
        self._lanes[lane] = gen
        return True

    def _grow(self, gens: list[Generation]) -> list[Generation]:
        """Give each of `gens` the block its next token needs, highest priority first,
        preempting the lowest-priority lane (perhaps one of `gens`) while the pool is dry.
        Returns those of `gens` still running."""
        for gen in sorted(gens, key=lambda g: g.priority):
            while gen.state == RUNNING and blocks_for(gen.n_cached + 1) > len(gen.blocks):
                block = self._allocate(1)
                if block is None:
                    self._preempt(max(self._running(), key=lambda g: g.priority))
                else:
                    gen.blocks += block
        return [g for g in gens if g.state == RUNNING]

    def _allocate(self, n_blocks: int) -> list[int] | None:
        self._trip(failpoints.ALLOC)
        return self.pool.allocate(n_blocks)

    def _preempt(self, gen: Generation) -> None:
        """Take `gen`'s lane and blocks; it waits at the front of its queue to recompute."""
        self._publish(gen)
        self.pool.release(gen.blocks)
        gen.blocks, gen.n_cached, gen.published = [], 0, 0
        self._lanes[gen.lane] = None
        self.preemptions += 1
        log.debug(f"torch engine: preempted a class-{gen.qos} generation at {len(gen.tokens)} tokens")
        with self._cond:
            gen.state = QUEUED
            self._queues[gen.qos].appendleft(gen)

    def _publish(self, gen: Generation) -> None:
        """Offer `gen`'s newly full blocks to the prefix cache."""
        if not self.prefix_cache:
            return
        while (gen.published + 1) * BLOCK_TOKENS <= gen.n_cached:
            self.pool.publish(gen.blocks[gen.published], gen.key(gen.published))
            gen.published += 1

    def _pick_prefill(self, waiting: list[Generation]) -> list[tuple[Generation, int]]:
        """Lanes to prefill this step and their chunks, padded work within the budget.

        The longest-waiting lane always goes first, so a long prompt is never starved; the rest
        are packed shortest first.
        """
        if not waiting:
            return []
        oldest = min(waiting, key=lambda g: g.admitted)
        rest = sorted((g for g in waiting if g is not oldest), key=lambda g: g.target - g.n_cached)
        picked: list[tuple[Generation, int]] = []
        width = 0
        for gen in [oldest, *rest]:
            chunk = min(gen.target - gen.n_cached, self.prefill_chunk)
            if picked and (len(picked) + 1) * max(width, chunk) > self.prefill_chunk:
                break
            picked.append((gen, chunk))
            width = max(width, chunk)
        return picked

    def _prefill(self, work: list[tuple[Generation, int]]) -> None:
        """Prefills `work`; out of memory, the oldest lane alone, and if that too runs out, it
        fails alone."""
        try:
            self._begin("prefill step", [g for g, _ in work])
            self._prefill_step(work)
        except Exception as e:
            if not is_out_of_memory(e) or len(work) == 1:
                self._fail_step([g for g, _ in work], "prefill", e)
                return
            log.warning(f"torch engine: out of memory prefilling {len(work)} lanes; prefilling the oldest alone")
            self._prefill(work[:1])

    def _decode(self, gens: list[Generation]) -> None:
        """Grows and decodes `gens`; out of memory, preempts the lower-priority half and runs the
        rest, down to one lane, which then fails alone."""
        while gens:
            try:
                self._begin("decode step", gens)
                running = self._grow(gens)
                if running:
                    self._decode_step(running)
                return
            except Exception as e:
                gens = [g for g in gens if g.state == RUNNING]
                if not is_out_of_memory(e) or len(gens) <= 1:
                    self._fail_step(gens, "decode", e)
                    return
                gens = self._shed(gens)

    def _shed(self, gens: list[Generation]) -> list[Generation]:
        """Preempts the lower-priority half of `gens` and caps the lanes at the rest for a while;
        the lanes kept."""
        ranked = sorted(gens, key=lambda g: g.priority)
        kept, shed = ranked[: len(ranked) // 2], ranked[len(ranked) // 2 :]
        for gen in shed:
            self._preempt(gen)
        self._lane_cap, self._calm_steps = len(kept), 0
        log.warning(
            f"torch engine: out of memory in a decode step over {len(gens)} lanes; preempted "
            f"{len(shed)}, running {len(kept)} until {OOM_CALM_STEPS} steps pass without it"
        )
        return kept

    def _fail_step(self, gens: list[Generation], kind: str, error: Exception) -> None:
        """A step raised: its generations fail and the scheduler goes on."""
        if is_out_of_memory(error):
            log.error(f"torch engine: out of memory in a one-lane {kind} step; its generation ends: {error}")
        else:
            log.error(
                f"torch engine: a {kind} step over {len(gens)} lane(s) failed ({error}); they end",
                exc_info=not isinstance(error, InjectedFault),
            )
        self._fail_all(gens, error)

    def _prefill_step(self, work: list[tuple[Generation, int]]) -> None:
        gens = [gen for gen, _ in work]
        counts = [chunk for _, chunk in work]
        rows = [g.tokens[g.n_cached : g.n_cached + c] for g, c in work]
        logits = self._forward(gens, rows, counts)
        self.prefill_tokens += sum(counts)
        first = []
        for row, (gen, chunk) in enumerate(work):
            gen.n_cached += chunk
            self._publish(gen)
            if not gen.prefilling and not gen.produced:
                first.append(row)
        if first:
            finished = [gens[row] for row in first]
            chosen = choose_tokens(logits[first], [g.sampler for g in finished])
            for gen, token in zip(finished, chosen, strict=True):
                self._emit(gen, token)

    def _decode_step(self, gens: list[Generation]) -> None:
        self._trip(failpoints.STEP)
        began = time.perf_counter()
        logits = self._forward(gens, [[g.tokens[-1]] for g in gens], [1] * len(gens))
        self.decode_forward_seconds += time.perf_counter() - began
        self.decode_tokens += len(gens)
        for gen in gens:
            gen.n_cached += 1
            self._publish(gen)
        for gen, token in zip(gens, choose_tokens(logits, [g.sampler for g in gens]), strict=True):
            self._emit(gen, token)
        self.decode_steps += 1
        self.decode_seconds += time.perf_counter() - began
        self._calm()

    def _calm(self) -> None:
        """One decode step ran: after enough, an out-of-memory lane cap grows by a lane."""
        if self._lane_cap == len(self._lanes):
            return
        self._calm_steps += 1
        if self._calm_steps >= OOM_CALM_STEPS:
            self._lane_cap, self._calm_steps = self._lane_cap + 1, 0

    def _forward(self, gens: list[Generation], rows: list[list[int]], counts: list[int]) -> torch.Tensor:
        """One batched forward of each lane's new tokens; logits [B,V] at each lane's last one."""
        device = self.model.device
        n_blocks = blocks_for(max(g.n_cached + c for g, c in zip(gens, counts, strict=True)))
        table = [g.blocks[:n_blocks] + [self.pool.scratch_block] * (n_blocks - len(g.blocks)) for g in gens]
        width = max(counts)
        batch = Batch(
            tokens=torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device),
            counts=torch.tensor(counts, device=device),
            starts=torch.tensor([g.n_cached for g in gens], device=device),
            blocks=torch.tensor(table, device=device),
            fresh=torch.tensor(self.pool.take_fresh(), dtype=torch.long, device=device),
        )
        if self.tensor_parallel is not None:
            self.tensor_parallel.send_forward(batch)
        last = forward_batch(self.model, self.pool, self._positions, batch, self.attention_kernels)
        return self.model.logits(last, greedy=all(g.sampler.greedy for g in gens))

    def _emit(self, gen: Generation, token: int) -> None:
        if gen.abandoned:
            return
        if token in self.eos:
            self._finish(gen, finish.EOS)
            return
        gen.tokens.append(token)
        gen.hand_over(token)
        if gen.produced >= gen.budget:
            self._finish(gen, finish.LENGTH)

    def _release(self, gen: Generation) -> None:
        self.pool.release(gen.blocks)
        gen.blocks = []
        self._lanes[gen.lane] = None
        gen.state = DONE

    def _finish(self, gen: Generation, code: int) -> None:
        self._release(gen)
        gen.out.put((END, code))

    def _fail_all(self, gens: list[Generation], error: Exception) -> None:
        for gen in gens:
            if gen.state == RUNNING:
                self._release(gen)
                gen.out.put((ERROR, f"the engine failed: {error}"))

    def _shut_down(self) -> None:
        for gen in self._running():
            self._finish(gen, finish.CANCELLED)
        with self._cond:
            for q in self._queues:
                while q:
                    self._end_queued(q.popleft())

    @staticmethod
    def _end_queued(gen: Generation) -> None:
        """Ends a generation taken off its queue before it ran: its caller gets CANCELLED."""
        gen.state = DONE
        gen.out.put((END, finish.CANCELLED))


@atexit.register
def _close_running() -> None:
    for scheduler in list(_RUNNING):
        scheduler.close()
