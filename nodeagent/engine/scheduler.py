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
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable

import torch

from nodeagent.daemon import QOS_CLASSES, Consumer, GenerationError, SchedStats
from nodeagent.engine.kvpool import BLOCK_TOKENS, KVPool, blocks_for, chain_key
from nodeagent.engine.model import LlamaModel, grouped_attention
from nodeagent.engine.sampling import LaneSampler, choose_tokens
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
        elif not self.consumer.offer([token]):
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
    ):
        self.model = model
        self.threads = threads
        self.pool = pool
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
        self._thread = threading.Thread(target=self._run, name="torch-scheduler", daemon=True)
        self._thread.start()

    # -- caller threads ------------------------------------------------------------------------

    def submit(self, gen: Generation) -> None:
        with self._cond:
            if self._stopping:
                raise GenerationError("the engine is closed")
            self._queues[gen.qos].append(gen)
            self._cond.notify()

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

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    # -- the scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        if self.threads is not None:
            # OpenMP keeps a thread count per calling thread: this sets the forward's own.
            torch.set_num_threads(self.threads)
        with torch.inference_mode():
            self.model.warm_projections(max(self.prefill_chunk, len(self._lanes)))
            while self._wait_for_work():
                try:
                    self._iteration()
                except Exception as e:  # a bookkeeping bug must not kill the thread silently
                    log.exception("torch engine: scheduler iteration failed")
                    self._fail_all(self._running(), e)
        self._shut_down()

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping and not self._running() and not any(self._queues):
                self._cond.wait()
            return not self._stopping

    def _iteration(self) -> None:
        self._sweep()
        self._yield_held_lanes()
        with self._cond:
            self._admit()
        prefill = self._pick_prefill([g for g in self._running() if g.prefilling])
        if prefill:
            self._guarded([g for g, _ in prefill], lambda: self._prefill_step(prefill))
        decode = self._grow([g for g in self._running() if not g.prefilling and g.held_since is None])
        if decode:
            self._guarded(decode, lambda: self._decode_step(decode))
        if not prefill and not decode:
            with self._cond:  # every lane is held back by its caller: wait, do not spin
                self._cond.wait(IDLE_WAIT_S)

    def _running(self) -> list[Generation]:
        return [g for g in self._lanes if g is not None]

    def _sweep(self) -> None:
        """Free the lanes of generations cancelled or past their deadline, and end those whose
        caller set its cancel event, running or queued."""
        now = time.monotonic()
        for gen in self._running():
            if gen.cancelled or gen.expired(now):
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
        short = waiting - sum(g is None for g in self._lanes)
        if short <= 0:
            return
        held = [g for g in self._running() if g.held_since is not None and now - g.held_since >= HELD_YIELD_S]
        for gen in sorted(held, key=lambda g: g.priority, reverse=True)[:short]:
            gen.held_since = None
            self._preempt(gen)

    def _admit(self) -> None:
        """Start queued generations by QoS class, passing over those held back by their caller;
        a head that cannot get its blocks waits."""
        free_lanes = [i for i, g in enumerate(self._lanes) if g is None]
        for q in self._queues:
            for gen in [g for g in q if not g.held_back()]:
                if not free_lanes or not self._start(gen, free_lanes[0]):
                    return
                q.remove(gen)
                free_lanes.pop(0)

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
        fresh = self.pool.allocate(need)
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
                block = self.pool.allocate(1)
                if block is None:
                    self._preempt(max(self._running(), key=lambda g: g.priority))
                else:
                    gen.blocks += block
        return [g for g in gens if g.state == RUNNING]

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

    def _guarded(self, gens: list[Generation], step: Callable[[], None]) -> None:
        """Run `step`; if it raises, `gens` fail and the scheduler goes on."""
        try:
            step()
        except Exception as e:
            log.exception("torch engine: a batched step failed")
            self._fail_all(gens, e)

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

    def _forward(self, gens: list[Generation], rows: list[list[int]], counts: list[int]) -> torch.Tensor:
        """One batched forward of each lane's new tokens; logits [B,V] at each lane's last one."""
        model, pool, device = self.model, self.pool, self.model.device
        width = max(counts)
        n_blocks = blocks_for(max(g.n_cached + c for g, c in zip(gens, counts, strict=True)))
        table = [g.blocks[:n_blocks] + [pool.scratch_block] * (n_blocks - len(g.blocks)) for g in gens]
        blocks = torch.tensor(table, device=device)
        starts = torch.tensor([g.n_cached for g in gens], device=device)
        tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
        positions = starts[:, None] + self._positions[:width]
        block_index = (positions // BLOCK_TOKENS).clamp(max=n_blocks - 1)
        write = blocks.gather(1, block_index) * BLOCK_TOKENS + positions % BLOCK_TOKENS
        if width > 1:
            valid = self._positions[:width] < torch.tensor(counts, device=device)[:, None]
            write = write.masked_fill(~valid, pool.scratch_slot)
            positions = positions.masked_fill(~valid, 0)
        mask = model.attention_mask(positions, n_blocks * BLOCK_TOKENS)
        write = write.reshape(-1)

        def attend(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            pool.write(layer, write, kv.reshape(-1, *kv.shape[2:]))
            keys, values = pool.read(layer, blocks)
            return grouped_attention(q, keys, values, mask)

        x = model.embed(tokens)
        freqs = model.rope(positions)
        for layer in range(model.config.n_layers):
            x = model.layer(layer, x, freqs, attend)
        if width == 1:
            last = x[:, 0]
        else:
            last = x[torch.arange(len(gens), device=device), torch.tensor(counts, device=device) - 1]
        return model.logits(last, greedy=all(g.sampler.greedy for g in gens))

    def _emit(self, gen: Generation, token: int) -> None:
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
