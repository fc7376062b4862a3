"""The unit tests of superfluid-proto's idempotency.rs, ported."""

import pytest

from proto.idempotency import (
    CommandTable,
    DedupOutcome,
    EventDedup,
    Gap,
    GenerationKey,
    LeaseClock,
    RetryBuffer,
)


def key(session_id, epoch, generation_id):
    return GenerationKey(session_id, epoch, generation_id)


def test_command_table_replay_returns_original_result():
    t = CommandTable()
    calls = []
    assert t.apply(1, lambda: calls.append(1) or 42) == (42, True)
    assert t.apply(1, lambda: calls.append(1) or 999) == (42, False)
    assert len(calls) == 1


def test_command_table_trim_drops_at_and_below_watermark():
    t = CommandTable()
    for i in range(1, 6):
        t.apply(i, lambda: ())
    assert len(t) == 5
    t.trim(3)
    assert len(t) == 2
    assert t.get(3) is None
    assert t.get(4) == ()
    assert t.get(5) == ()


def test_command_table_trim_at_u64_max_clears_everything():
    t = CommandTable()
    t.apply(2**64 - 1, lambda: ())
    t.trim(2**64 - 1)
    assert len(t) == 0


def test_event_dedup_fences_stale_epochs():
    d = EventDedup()
    d.set_session_epoch(1, 5)
    assert d.accept(key(1, 4, 1), 0) is DedupOutcome.StaleEpoch
    assert d.watermark(key(1, 4, 1)) is None
    assert d.accept(key(1, 5, 1), 0) is DedupOutcome.Accepted

    assert d.tracked_generations() == 1
    d.set_session_epoch(1, 6)
    assert d.tracked_generations() == 0
    assert d.accept(key(1, 5, 1), 1) is DedupOutcome.StaleEpoch


def test_event_dedup_older_epoch_does_not_drop_newer_generations():
    d = EventDedup()
    d.set_session_epoch(1, 6)
    d.accept(key(1, 6, 1), 0)
    d.set_session_epoch(1, 5)
    assert d.tracked_generations() == 1


def test_event_dedup_gc_is_bounded():
    d = EventDedup()
    for g in range(10):
        d.accept(key(1, 1, g), 0)
    assert d.tracked_generations() == 10
    for g in range(10):
        d.retire_generation(key(1, 1, g))
    assert d.tracked_generations() == 0

    d.accept(key(2, 1, 1), 0)
    d.accept(key(3, 1, 1), 0)
    d.retire_session(2)
    assert d.tracked_generations() == 1


def test_event_dedup_contiguous_accept():
    d = EventDedup()
    k = key(1, 1, 1)
    for seq in range(3):
        assert d.accept(k, seq) is DedupOutcome.Accepted
    assert d.watermark(k) == 2


def test_event_dedup_retransmit_after_lost_ack_is_deduped():
    d = EventDedup()
    k = key(1, 1, 1)
    d.accept(k, 0)
    d.accept(k, 1)
    assert d.accept(k, 0) is DedupOutcome.AlreadyCommitted
    assert d.accept(k, 1) is DedupOutcome.AlreadyCommitted
    assert d.watermark(k) == 1


def test_event_dedup_gap_rejected():
    d = EventDedup()
    k = key(1, 1, 1)
    d.accept(k, 0)
    with pytest.raises(Gap) as err:
        d.accept(k, 2)
    assert err.value == Gap(key=k, expected=1, got=2)
    assert "expected 1, got 2" in str(err.value)
    assert d.watermark(k) == 0


def test_event_dedup_generations_are_independent():
    d = EventDedup()
    g1, g2 = key(1, 1, 1), key(1, 1, 2)
    d.accept(g1, 0)
    d.accept(g1, 1)
    d.accept(g2, 0)
    assert d.watermark(g1) == 1
    assert d.watermark(g2) == 0


def test_retry_buffer_ack_trims_contiguous_prefix():
    b = RetryBuffer()
    b.push(0, "a")
    b.push(1, "b")
    b.push(2, "c")
    b.ack(1)
    assert len(b) == 1
    assert b.retransmit_from(0) == ["c"]


def test_retry_buffer_retransmit_from_yields_tail():
    b = RetryBuffer()
    for i in range(5):
        b.push(i, i * 10)
    assert b.retransmit_from(3) == [30, 40]
    assert b.retransmit_from(0) == [0, 10, 20, 30, 40]
    assert b.retransmit_from(100) == []


def test_retry_buffer_ack_all_empties_buffer():
    b = RetryBuffer()
    b.push(0, 1)
    b.push(1, 2)
    b.ack(1)
    assert len(b) == 0


def test_lease_clock_renew_and_expiry_boundaries():
    received = 100_000
    clock = LeaseClock(received, 10_000, 8_000)

    assert not clock.must_renew(received + 7_999)
    assert clock.must_renew(received + 8_000)
    assert clock.must_renew(received + 8_001)

    assert not clock.expired(received + 9_999)
    assert clock.expired(received + 10_000)
    assert clock.expired(received + 20_000)


def test_lease_clock_now_before_receipt_is_never_expired():
    clock = LeaseClock(100_000, 10_000, 8_000)
    assert not clock.must_renew(50_000)
    assert not clock.expired(50_000)
