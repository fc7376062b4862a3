"""Postcard codec speed against cbor2 (a C codec) on the same data as plain dicts and lists.

Prints, per message and direction, the best time per call of ours and of cbor2 and the ratio
ours/cbor2. Targets: at most 1.0 on the node's hot path (TokenEvents encode, WatermarkAck and
LeaseGrant decode), at most 2.0 everywhere.

Run: .venv/bin/python tests/bench/codec.py
"""

import timeit

import cbor2

from proto.handshake import CapacitySummary, HelloAckF, LinkFLimits
from proto.linkf import (
    LeaseGrantMsg,
    NodeStatusMsg,
    TokenEvent,
    TokenEventPayload,
    TokenEventsMsg,
    WatermarkAckMsg,
)
from proto.linkw import MemCountersMsg
from proto.postcard import from_bytes, to_bytes, to_plain

HOT = {("TokenEventsMsg", "encode"), ("WatermarkAckMsg", "decode"), ("LeaseGrantMsg", "decode")}
REPEATS = 7


def messages():
    capacity = CapacitySummary(
        gpu_memory_bytes=80 << 30,
        gpu_memory_free_bytes=12 << 30,
        host_memory_bytes=512 << 30,
        active_sessions=3,
        max_sessions=0xFFFFFFFF,
        max_context_tokens=131072,
        kv_blocks_used=1200,
        kv_blocks_total=8192,
        lanes_active=2,
        max_lanes=8,
        queue_depth=1,
        decode_tokens_per_s=85,
        prefill_tokens_per_s=4200,
        sampled_at_ms=93_512_004,
    )
    tokens = [151_643, 785, 3_921, 13, 40_000, 2_057, 11, 99_321, 128, 5, 64_012, 1_024, 30_000, 7, 151_645, 220]
    return [
        TokenEventsMsg(
            events=[
                TokenEvent(
                    session_id=4_211,
                    epoch=97,
                    generation_id=35,
                    event_seq=12,
                    payload=TokenEventPayload.Tokens(tokens=tokens),
                )
            ]
        ),
        WatermarkAckMsg(session_id=4_211, epoch=97, generation_id=35, watermark=12),
        LeaseGrantMsg(session_id=4_211, epoch=97, duration_ms=60_000, renew_by_ms=40_000),
        NodeStatusMsg(
            capacity=capacity,
            loadable_models=["qwen3-8b"],
            mem=MemCountersMsg(pool_blocks_total=8192, pool_blocks_used=1200),
        ),
        HelloAckF(
            chosen_version=3,
            node_identity="node-gpu-07",
            capacity=capacity,
            loadable_models=["qwen3-8b"],
            feature_flags=0,
            limits=LinkFLimits(max_frame=16 << 20, transfer_window=8, max_transfer=1 << 26, transfer_budget=1 << 28),
        ),
    ]


def best_pair(ours, theirs):
    """Seconds per call of each, the best of REPEATS interleaved runs of about 50 ms each, so that
    a load change on the machine hits both alike."""
    number = max(1, timeit.Timer(theirs).autorange()[0] // 4)
    times = {ours: [], theirs: []}
    for _ in range(REPEATS):
        for fn in (ours, theirs):
            times[fn].append(timeit.timeit(fn, number=number) / number)
    return min(times[ours]), min(times[theirs])


def main():
    rows = []
    for msg in messages():
        cls, data = type(msg), to_plain(msg)
        ours_bytes, cbor_bytes = to_bytes(msg), cbor2.dumps(data)
        assert from_bytes(cls, ours_bytes) == msg and cbor2.loads(cbor_bytes) == data
        rows.append((cls.__name__, "encode", *best_pair(lambda: to_bytes(msg), lambda: cbor2.dumps(data))))
        rows.append(
            (cls.__name__, "decode", *best_pair(lambda: from_bytes(cls, ours_bytes), lambda: cbor2.loads(cbor_bytes)))
        )
    print(f"{'message':<16} {'dir':<7} {'ours µs':>8} {'cbor2 µs':>9} {'ratio':>6}  target")
    over = 0
    for name, direction, ours, theirs in rows:
        ratio = ours / theirs
        target = 1.0 if (name, direction) in HOT else 2.0
        over += ratio > target
        mark = "ok" if ratio <= target else "OVER"
        print(f"{name:<16} {direction:<7} {ours * 1e6:>8.2f} {theirs * 1e6:>9.2f} {ratio:>6.2f}  ≤{target:.1f} {mark}")
    print(f"{len(rows) - over} of {len(rows)} within target")


if __name__ == "__main__":
    main()
