"""The KV pool's bookkeeping as a state machine: holds, the prefix cache, LRU eviction."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nodeagent.engine.kvpool import KVPool, chain_key

BLOCKS = 6


def pool() -> KVPool:
    return KVPool(1, 1, 2, BLOCKS, torch.float32, torch.device("cpu"))


def block_value(pool: KVPool, block: int) -> float:
    return float(pool.blocks(block)[0, 0, 0, 0, 0])


class PoolMachine(RuleBasedStateMachine):
    """A model of who holds which block, which keys are cached and in what order they were
    last released; each block's first slot holds a stamp, so a block handed out again while
    its old content is still cached would show."""

    @initialize()
    def start(self) -> None:
        self.pool = pool()
        self.holds: list[int] = []  # one entry per hold
        self.keys: dict[bytes, int] = {}
        self.stamp: dict[int, float] = {}
        self.idle_order: list[int] = []  # unheld keyed blocks, least recently released first
        self.next_stamp = 1.0

    def _unheld_keyed(self) -> list[int]:
        return [b for b in self.keys.values() if b not in self.holds]

    @rule(n=st.integers(0, 3))
    def allocate(self, n: int) -> None:
        taken = self.pool.allocate(n)
        free = BLOCKS - len(set(self.holds)) - len(self._unheld_keyed())
        if n > free + len(self._unheld_keyed()):
            assert taken is None
            return
        assert taken is not None and len(set(taken)) == n
        assert not set(taken) & set(self.holds), "a held block was handed out"
        evicted = [b for b in taken if b in self.keys.values()]
        assert taken == sorted(taken), "a lane's blocks run in order in memory"
        assert sorted(evicted) == sorted(self.idle_order[: len(evicted)]), "eviction is least recently released first"
        for block in evicted:
            self.idle_order.remove(block)
            self.keys = {k: b for k, b in self.keys.items() if b != block}
        for block in taken:
            assert block_value(self.pool, block) == 0.0, "a block is zeroed when handed out"
            self.pool.blocks(block)[0, 0, 0, 0, 0] = self.next_stamp
            self.stamp[block] = self.next_stamp
            self.next_stamp += 1
        self.holds += taken

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def release(self, data) -> None:
        block = data.draw(st.sampled_from(self.holds))
        self.pool.release([block])
        self.holds.remove(block)
        if block not in self.holds and block in self.keys.values():
            self.idle_order.append(block)

    @precondition(lambda self: self.holds)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=16, max_size=16))
    def publish(self, data, tokens: list[int]) -> None:
        block = data.draw(st.sampled_from(self.holds))
        key = chain_key(b"", tokens)
        self.pool.publish(block, key)
        if key not in self.keys and block not in self.keys.values():
            self.keys[key] = block

    @rule(tokens=st.lists(st.integers(0, 3), min_size=16, max_size=16))
    def match_and_hold(self, tokens: list[int]) -> None:
        key = chain_key(b"", tokens)
        found = self.pool.match([key])
        assert found == ([self.keys[key]] if key in self.keys else [])
        if found:
            assert block_value(self.pool, found[0]) == self.stamp[found[0]], "cached content survived"
            self.pool.hold(found)
            if found[0] in self.idle_order:
                self.idle_order.remove(found[0])
            self.holds += found

    @invariant()
    def counts_add_up(self) -> None:
        assert self.pool.used == len(set(self.holds))
        assert self.pool.used + self.pool.available == BLOCKS
        assert self.pool.cached == len(self.keys)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


def test_keys_name_the_whole_prefix():
    a, b = [1] * 16, [2] * 16
    assert chain_key(chain_key(b"", a), b) != chain_key(chain_key(b"", b), b)
    assert chain_key(b"", a) == chain_key(b"", list(a))


def test_blocks_handed_out_are_zeroed_whatever_the_storage_held():
    """The storage starts empty (garbage, possibly NaN, that attention must never see)."""
    p = KVPool(2, 2, 8, 8, torch.float32, torch.device("cpu"))
    assert bool((p.blocks(p.scratch_block) == 0).all())
    p.blocks(slice(p.total)).fill_(float("nan"))
    blocks = p.allocate(3)
    assert bool((p.blocks(blocks) == 0).all())
    assert bool(p.blocks([b for b in range(p.total) if b not in blocks]).isnan().all())


def test_each_handed_out_block_is_reported_fresh_once_for_the_other_ranks_to_zero():
    pool = KVPool(1, 1, 2, 4, torch.float32, torch.device("cpu"))
    pool.kv.fill_(float("nan"))
    first = pool.allocate(2)
    assert pool.take_fresh() == first and pool.take_fresh() == []
    assert not pool.blocks(first).isnan().any(), "handed out zeroed"
    pool.release(first)
    again = pool.allocate(1)
    assert pool.take_fresh() == again


def test_the_free_blocks_a_lane_held_come_back_first_to_last():
    pool = KVPool(1, 1, 2, 8, torch.float32, torch.device("cpu"))
    first = pool.allocate(5)
    assert first == [0, 1, 2, 3, 4]
    pool.release(first)
    assert pool.allocate(3) == [0, 1, 2]


def test_a_released_chain_is_evicted_from_its_tail():
    """A prefix match needs a chain's first blocks, so its last ones are the first to go."""
    pool = KVPool(1, 1, 2, 4, torch.float32, torch.device("cpu"))
    chain = pool.allocate(4)
    keys = []
    for n, block in enumerate(chain):
        keys.append(chain_key(keys[-1] if keys else b"", [n] * 16))
        pool.publish(block, keys[-1])
    pool.release(chain)
    pool.allocate(1)
    assert pool.match(keys) == chain[:3]
