"""Continuous batching on one thread: every step runs ONE forward for all decoding lanes.

Callers submit a `Generation` and read its `out` queue; only this thread touches the lanes,
the KV pool and the model's KV writes. A prompt is prefilled in chunks between decode steps so
a long prompt never stalls the lanes already running. A generation reserves the KV blocks for
its whole length when admitted, so it never runs out mid-way; one that cannot get them waits in
its QoS queue.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import Callable

import torch

from nodeagent import finish
from nodeagent.daemon import QOS_CLASSES, GenerationError, SchedStats
from nodeagent.engine.kvpool import BLOCK_TOKENS, KVPool, blocks_for
from nodeagent.engine.model import LlamaModel, grouped_attention
from nodeagent.engine.sampling import LaneSampler, choose_tokens

log = logging.getLogger(__name__)

QUEUED, RUNNING, DONE = "queued", "running", "done"

#: Messages on `Generation.out`: ("token", id), ("done", finish code), ("error", message).
TOKEN, END, ERROR = "token", "done", "error"


class Generation:
    """One generation: what the caller asked for, and its lane state on the scheduler thread."""

    def __init__(
        self,
        stream: list[int],
        budget: int,
        deadline: float | None,
        qos: int,
        sampler: LaneSampler,
    ):
        self.stream = stream
        self.budget = budget
        self.deadline = deadline
        self.qos = qos
        self.sampler = sampler
        self.out: queue.Queue = queue.Queue()
        self.cancelled = False
        self.state = QUEUED
        self.lane = -1
        self.admitted = 0
        self.blocks: list[int] = []
        self.n_cached = 0
        self.next_token = 0
        self.produced = 0

    @property
    def kv_tokens(self) -> int:
        """Positions it will ever write: the stream and every token but the last produced."""
        return len(self.stream) + self.budget - 1

    @property
    def prefilling(self) -> bool:
        return self.n_cached < len(self.stream)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


class Scheduler:
    """The batching thread and its bookkeeping."""

    def __init__(
        self,
        model: LlamaModel,
        pool: KVPool,
        max_batch: int,
        max_context: int,
        prefill_chunk: int = 512,
    ):
        self.model = model
        self.pool = pool
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.eos = frozenset(model.config.eos_token_ids)
        device = model.device
        self._block_table = torch.full(
            (max_batch, blocks_for(max_context)), pool.scratch_block, dtype=torch.long, device=device
        )
        self._positions = torch.arange(blocks_for(max_context) * BLOCK_TOKENS, device=device)
        self._lanes: list[Generation | None] = [None] * max_batch
        self._queues: list[collections.deque[Generation]] = [
            collections.deque() for _ in range(QOS_CLASSES)
        ]
        self._cond = threading.Condition()
        self._stopping = False
        self._admissions = itertools.count()
        self.decode_tokens = 0
        self.prefill_tokens = 0
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
        with torch.inference_mode():
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
        with self._cond:
            self._admit()
        prefill = self._pick_prefill([g for g in self._running() if g.prefilling])
        if prefill:
            self._guarded([g for g, _ in prefill], lambda: self._prefill_step(prefill))
        decode = [g for g in self._running() if not g.prefilling]
        if decode:
            self._guarded(decode, lambda: self._decode_step(decode))

    def _running(self) -> list[Generation]:
        return [g for g in self._lanes if g is not None]

    def _sweep(self) -> None:
        """Free the lanes of generations cancelled or past their deadline."""
        now = time.monotonic()
        for gen in self._running():
            if gen.cancelled or gen.expired(now):
                self._release(gen)

    def _admit(self) -> None:
        """Start queued generations by QoS class; a head that cannot get its blocks waits."""
        free_lanes = [i for i, g in enumerate(self._lanes) if g is None]
        for q in self._queues:
            while q and free_lanes:
                gen = q[0]
                blocks = self.pool.allocate(blocks_for(gen.kv_tokens))
                if blocks is None:
                    return
                q.popleft()
                self._start(gen, free_lanes.pop(0), blocks)

    def _start(self, gen: Generation, lane: int, blocks: list[int]) -> None:
        gen.state, gen.lane, gen.blocks = RUNNING, lane, blocks
        gen.admitted = next(self._admissions)
        table = self._block_table[lane]
        table.fill_(self.pool.scratch_block)
        table[: len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        self._lanes[lane] = gen

    def _pick_prefill(self, waiting: list[Generation]) -> list[tuple[Generation, int]]:
        """Lanes to prefill this step and their chunks, padded work within the budget.

        The longest-waiting lane always goes first, so a long prompt is never starved; the rest
        are packed shortest first.
        """
        if not waiting:
            return []
        oldest = min(waiting, key=lambda g: g.admitted)
        rest = sorted((g for g in waiting if g is not oldest), key=lambda g: len(g.stream) - g.n_cached)
        picked: list[tuple[Generation, int]] = []
        width = 0
        for gen in [oldest, *rest]:
            chunk = min(len(gen.stream) - gen.n_cached, self.prefill_chunk)
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
        rows = [g.stream[g.n_cached : g.n_cached + c] for g, c in work]
        logits = self._forward(gens, rows, counts)
        self.prefill_tokens += sum(counts)
        done = []
        for row, (gen, chunk) in enumerate(work):
            gen.n_cached += chunk
            if not gen.prefilling:
                done.append(row)
        if done:
            finished = [gens[row] for row in done]
            chosen = choose_tokens(logits[done], [g.sampler for g in finished])
            for gen, token in zip(finished, chosen):
                self._emit(gen, token)

    def _decode_step(self, gens: list[Generation]) -> None:
        logits = self._forward(gens, [[g.next_token] for g in gens], [1] * len(gens))
        self.decode_tokens += len(gens)
        for gen in gens:
            gen.n_cached += 1
        for gen, token in zip(gens, choose_tokens(logits, [g.sampler for g in gens])):
            self._emit(gen, token)

    def _forward(self, gens: list[Generation], rows: list[list[int]], counts: list[int]) -> torch.Tensor:
        """One batched forward of each lane's new tokens; logits [B,V] at each lane's last one."""
        model, pool, device = self.model, self.pool, self.model.device
        width = max(counts)
        lanes = torch.tensor([g.lane for g in gens], device=device)
        starts = torch.tensor([g.n_cached for g in gens], device=device)
        tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
        positions = starts[:, None] + self._positions[:width]
        block_index = positions.clamp(max=self.max_context - 1) // BLOCK_TOKENS
        write = self._block_table[lanes[:, None], block_index] * BLOCK_TOKENS + positions % BLOCK_TOKENS
        if width > 1:
            valid = self._positions[:width] < torch.tensor(counts, device=device)[:, None]
            write = write.masked_fill(~valid, pool.scratch_slot)
            positions = positions.masked_fill(~valid, 0)
        n_blocks = blocks_for(max(g.n_cached + c for g, c in zip(gens, counts)))
        blocks = self._block_table.index_select(0, lanes)[:, :n_blocks]
        mask = (self._positions[: n_blocks * BLOCK_TOKENS] <= positions[:, :, None]).unsqueeze(1)
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
        return model.logits(last)

    def _emit(self, gen: Generation, token: int) -> None:
        if token in self.eos:
            self._finish(gen, finish.EOS)
            return
        gen.produced += 1
        gen.next_token = token
        gen.out.put((TOKEN, token))
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
                    gen = q.popleft()
                    gen.state = DONE
                    gen.out.put((END, finish.CANCELLED))
