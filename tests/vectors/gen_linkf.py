"""Writes linkf.cbor: golden postcard vectors, every byte spelled out by hand from the rules of
linkf-wire.md §2, never produced by our encoder.

Each record is `{name, msg_type, type, fields, postcard}`: `msg_type` is the catalog number (None
for the bare-type vectors of §2, which name their `type` instead); `fields` is the value as plain
data: a struct is a dict of its fields in order, a data-enum value `{Variant: {fields}}`, an enum of
unit variants its index, a tuple a list.

Varints below are worked out group by group: v = 300 = 0b10_0101100 gives 0x2c | 0x80, then 0x02,
written `ac 02`.

Run: .venv/bin/python tests/vectors/gen_linkf.py
"""

from pathlib import Path

import cbor2

RECORDS = []


def record(name, msg_type, fields, parts, type_name=None):
    """`parts`: (what, hex) pairs, concatenated in order; `what` says which rule gives the bytes."""
    data = bytes.fromhex(" ".join(h for _, h in parts))
    RECORDS.append({"name": name, "msg_type": msg_type, "type": type_name, "fields": fields, "postcard": data})


# §2 worked vectors

for value, hex_ in [(0, "00"), (127, "7f"), (128, "80 01"), (16384, "80 80 01"), (65535, "ff ff 03")]:
    record(f"u16 {value}", None, value, [(f"u16 {value}: LEB128", hex_)], "u16")

record("Vec<u32> []", None, [], [("length 0", "00")], "Vec<u32>")
record(
    "Vec<u32> [1, 2, 300]",
    None,
    [1, 2, 300],
    [("length 3", "03"), ("1", "01"), ("2", "02"), ("300 = 2*128 + 44", "ac 02")],
    "Vec<u32>",
)
record(
    "Vec<u32> [0xFFFFFFFF]",
    None,
    [0xFFFFFFFF],
    [("length 1", "01"), ("2^32-1: four full groups of 7 ones, then 0b1111", "ff ff ff ff 0f")],
    "Vec<u32>",
)

GEN_PARAMS_ZERO = {"temperature": 0.0, "top_p": 0.0, "min_p": 0.0, "top_k": 0, "seed": 0}
record(
    "GenParams::default()",
    None,
    GEN_PARAMS_ZERO,
    [("three f32 0.0", "00 00 00 00 " * 3), ("top_k 0", "00"), ("seed 0", "00")],
    "GenParams",
)

# f32 0.7 is 0x3f333333 (0x1.666666p-1), 0.95 is 0x3f733333 (0x1.e66666p-1): little-endian.
F32_07 = float.fromhex("0x1.666666p-1")
F32_095 = float.fromhex("0x1.e66666p-1")
GEN_PARAMS = {"temperature": F32_07, "top_p": F32_095, "min_p": 0.0, "top_k": 40, "seed": 42}
GEN_PARAMS_HEX = "33 33 33 3f  33 33 73 3f  00 00 00 00  28  2a"
record(
    "GenParams{0.7, 0.95, 0, 40, 42}",
    None,
    GEN_PARAMS,
    [
        ("temperature f32 0x3f333333", "33 33 33 3f"),
        ("top_p f32 0x3f733333", "33 33 73 3f"),
        ("min_p f32 0", "00 00 00 00"),
        ("top_k 40", "28"),
        ("seed 42", "2a"),
    ],
    "GenParams",
)

# Shared pieces

CAPACITY = {
    "gpu_memory_bytes": 1 << 34,
    "gpu_memory_free_bytes": 0,
    "host_memory_bytes": 0,
    "active_sessions": 2,
    "max_sessions": 0xFFFFFFFF,
    "max_context_tokens": 4096,
    "kv_blocks_used": 5,
    "kv_blocks_total": 128,
    "lanes_active": 1,
    "max_lanes": 4,
    "queue_depth": 0,
    "decode_tokens_per_s": 150,
    "prefill_tokens_per_s": 0,
    "sampled_at_ms": 123456,
}
CAPACITY_PARTS = [
    ("gpu_memory_bytes 2^34: four empty groups, then bit 6 of the fifth", "80 80 80 80 40"),
    ("gpu_memory_free_bytes 0", "00"),
    ("host_memory_bytes 0", "00"),
    ("active_sessions 2", "02"),
    ("max_sessions u32::MAX", "ff ff ff ff 0f"),
    ("max_context_tokens 4096 = 32*128", "80 20"),
    ("kv_blocks_used 5", "05"),
    ("kv_blocks_total 128", "80 01"),
    ("lanes_active 1", "01"),
    ("max_lanes 4", "04"),
    ("queue_depth 0", "00"),
    ("decode_tokens_per_s 150 = 1*128 + 22", "96 01"),
    ("prefill_tokens_per_s 0", "00"),
    ("sampled_at_ms 123456 = (7*128 + 68)*128 + 64", "c0 c4 07"),
]
LEASE_10S = {"duration_ms": 10000, "renew_by_ms": 8000}
LEASE_10S_PARTS = [("duration_ms 10000 = 78*128 + 16", "90 4e"), ("renew_by_ms 8000 = 62*128 + 64", "c0 3e")]

# The catalog, in msg_type order

record(
    "HELLO",
    0x0001,
    {"proto_versions": [2, 3], "link_role": 2, "auth": b"tok"},
    [("proto_versions (2, 3)", "02 03"), ("link_role HeadDaemon = variant 2", "02"), ("auth len 3, 'tok'", "03 74 6f 6b")],
)
record(
    "HELLO_ACK_F",
    0x0002,
    {
        "chosen_version": 3,
        "node_identity": "node-a",
        "capacity": CAPACITY,
        "loadable_models": ["m"],
        "feature_flags": 0,
        "limits": {"max_frame": 1 << 24, "transfer_window": 8, "max_transfer": 1 << 26, "transfer_budget": 1 << 28},
    },
    [("chosen_version 3", "03"), ("node_identity len 6, 'node-a'", "06 6e 6f 64 65 2d 61")]
    + CAPACITY_PARTS
    + [
        ("loadable_models: 1 string, len 1, 'm'", "01 01 6d"),
        ("feature_flags 0", "00"),
        ("max_frame 2^24: three empty groups, then bit 3", "80 80 80 08"),
        ("transfer_window 8", "08"),
        ("max_transfer 2^26: three empty groups, then bit 5", "80 80 80 20"),
        ("transfer_budget 2^28: four empty groups, then bit 0", "80 80 80 80 01"),
    ],
)
record(
    "RECONCILE",
    0x0003,
    {
        "sessions": [
            {
                "session_id": 1,
                "epoch": 4,
                "lease_state": {"lease": LEASE_10S, "elapsed_ms": 1000},
                "command_watermark": 500,
                "generation_watermarks": [
                    {"generation_id": 1, "watermark": 100},
                    {"generation_id": 2, "watermark": None},
                ],
            }
        ]
    },
    [("sessions: 1", "01"), ("session_id 1", "01"), ("epoch 4", "04")]
    + LEASE_10S_PARTS
    + [
        ("elapsed_ms 1000 = 7*128 + 104", "e8 07"),
        ("command_watermark 500 = 3*128 + 116", "f4 03"),
        ("generation_watermarks: 2", "02"),
        ("generation 1, Some(100)", "01 01 64"),
        ("generation 2, None", "02 00"),
    ],
)
record(
    "RECONCILE_ACK",
    0x0004,
    {
        "sessions": [
            {
                "session_id": 1,
                "held": True,
                "retry_ranges": [{"generation_id": 1, "from_seq": 90, "to_seq": 100}],
                "lease_view": {"lease": LEASE_10S, "elapsed_ms": 1500},
            },
            {
                "session_id": 2,
                "held": False,
                "retry_ranges": [],
                "lease_view": {"lease": {"duration_ms": 0, "renew_by_ms": 0}, "elapsed_ms": 0},
            },
        ]
    },
    [("sessions: 2", "02"), ("session_id 1", "01"), ("held true", "01"), ("retry_ranges: 1", "01")]
    + [("generation 1, seqs 90 ..= 100", "01 5a 64")]
    + LEASE_10S_PARTS
    + [("elapsed_ms 1500 = 11*128 + 92", "dc 0b")]
    + [("session_id 2, held false, no ranges", "02 00 00"), ("lease_view all zeros", "00 00 00")],
)
record(
    "SESSION_ASSIGN",
    0x0005,
    {
        "command_id": 1001,
        "session_id": 55,
        "epoch": 3,
        "lease": {"duration_ms": 30000, "renew_by_ms": 20000},
        "codec": "raw",
        "params": bytes.fromhex(GEN_PARAMS_HEX),
        "qos_class": 1,
        "policy_ref": 42,
    },
    [
        ("command_id 1001 = 7*128 + 105", "e9 07"),
        ("session_id 55", "37"),
        ("epoch 3", "03"),
        ("duration_ms 30000 = (1*128 + 106)*128 + 48", "b0 ea 01"),
        ("renew_by_ms 20000 = (1*128 + 28)*128 + 32", "a0 9c 01"),
        ("codec len 3, 'raw'", "03 72 61 77"),
        ("params: len 14, the GenParams{0.7, 0.95, 0, 40, 42} vector", "0e " + GEN_PARAMS_HEX),
        ("qos_class u8 1", "01"),
        ("policy_ref 42", "2a"),
    ],
)
record(
    "SESSION_REVOKE",
    0x0006,
    {"command_id": 1002, "session_id": 55, "epoch": 3},
    [("command_id 1002 = 7*128 + 106", "ea 07"), ("session_id 55", "37"), ("epoch 3", "03")],
)
record(
    "POLICY_UPDATE",
    0x0007,
    {"policy_version": 7, "envelope": b"\x00\xff"},
    [("policy_version 7", "07"), ("envelope len 2", "02 00 ff")],
)
record("LEASE_RENEW", 0x0008, {"session_id": 55, "epoch": 3}, [("session_id 55", "37"), ("epoch 3", "03")])
record(
    "LEASE_GRANT",
    0x0009,
    {"session_id": 55, "epoch": 3, "duration_ms": 60000, "renew_by_ms": 40000},
    [
        ("session_id 55", "37"),
        ("epoch 3", "03"),
        ("duration_ms 60000 = (3*128 + 84)*128 + 96", "e0 d4 03"),
        ("renew_by_ms 40000 = (2*128 + 56)*128 + 64", "c0 b8 02"),
    ],
)
record(
    "APPEND_CONTENT",
    0x000A,
    {
        "command_id": 1003,
        "session_id": 55,
        "epoch": 3,
        "blocks": bytes.fromhex("03 01 02 ac 02"),
        "spans": [{"start": 0, "end": 3}],
        "media_refs": [b"\xab" * 32],
    },
    [
        ("command_id 1003 = 7*128 + 107", "eb 07"),
        ("session_id 55, epoch 3", "37 03"),
        ("blocks: len 5, the Vec<u32> [1, 2, 300] vector", "05 03 01 02 ac 02"),
        ("spans: 1, 0 .. 3", "01 00 03"),
        ("media_refs: 1, 32 raw bytes, no length", "01" + " ab" * 32),
    ],
)
record(
    "GENERATE_REQ",
    0x000B,
    {
        "command_id": 1004,
        "session_id": 55,
        "epoch": 3,
        "generation_id": 1,
        "budgets": {"max_new_tokens": 256, "max_wall_ms": 120000},
        "policy_ref": 0,
    },
    [
        ("command_id 1004 = 7*128 + 108", "ec 07"),
        ("session_id 55, epoch 3, generation_id 1", "37 03 01"),
        ("max_new_tokens 256 = 2*128", "80 02"),
        ("max_wall_ms 120000 = (7*128 + 41)*128 + 64", "c0 a9 07"),
        ("policy_ref 0", "00"),
    ],
)
record(
    "PARK_REQ",
    0x000C,
    {"command_id": 1005, "session_id": 55, "epoch": 3, "generation_id": 1},
    [("command_id 1005 = 7*128 + 109", "ed 07"), ("session_id 55, epoch 3, generation_id 1", "37 03 01")],
)
record(
    "RESUME_REQ",
    0x000D,
    {
        "command_id": 1006,
        "session_id": 55,
        "epoch": 3,
        "generation_id": 1,
        "budgets": {"max_new_tokens": 16, "max_wall_ms": 0},
        "policy_ref": 9,
    },
    [
        ("command_id 1006 = 7*128 + 110", "ee 07"),
        ("session_id 55, epoch 3, generation_id 1", "37 03 01"),
        ("budgets 16, 0", "10 00"),
        ("policy_ref 9", "09"),
    ],
)


def event(seq, payload):
    return {"session_id": 55, "epoch": 3, "generation_id": 1, "event_seq": seq, "payload": payload}


record(
    "TOKEN_EVENTS",
    0x000E,
    {
        "events": [
            event(0, {"Tokens": {"tokens": [10, 20, 300]}}),
            event(1, {"Segment": {"kind": 1, "data": b"hi"}}),
            event(2, {"Usage": {"usage": {"input_tokens": 12, "output_tokens": 34}}}),
            event(3, {"Finish": {"reason": 1}}),
        ]
    },
    [
        ("events: 4", "04"),
        ("55, 3, 1, seq 0", "37 03 01 00"),
        ("variant 0 Tokens: 3 tokens 10, 20, 300", "00 03 0a 14 ac 02"),
        ("55, 3, 1, seq 1", "37 03 01 01"),
        ("variant 1 Segment: kind ReasoningDelta 1, data len 2 'hi'", "01 01 02 68 69"),
        ("55, 3, 1, seq 2", "37 03 01 02"),
        ("variant 2 Usage: 12, 34", "02 0c 22"),
        ("55, 3, 1, seq 3", "37 03 01 03"),
        ("variant 3 Finish: reason EOS 1", "03 01"),
    ],
)
record(
    "TOKEN_EVENTS declined",
    0x000E,
    {"events": [event(0, {"Finish": {"reason": 0xFFFFFFFD}})]},
    [
        ("events: 1", "01"),
        ("55, 3, 1, seq 0", "37 03 01 00"),
        ("variant 3 Finish: FINISH_DECLINED 2^32-3 = low group 0x7d, ones, 0b1111", "03 fd ff ff ff 0f"),
    ],
)
record(
    "WATERMARK_ACK",
    0x000F,
    {"session_id": 55, "epoch": 3, "generation_id": 1, "watermark": 3},
    [("55, 3, 1, watermark 3", "37 03 01 03")],
)
record(
    "XFER_BEGIN",
    0x0010,
    {"transfer_id": 1, "total_len": 4096, "checksum": 0xDEADBEEF, "content_type": 1, "content_hash": b"\x07" * 32},
    [
        ("transfer_id 1", "01"),
        ("total_len 4096", "80 20"),
        ("checksum 0xdeadbeef: groups 0x6f 0x7d 0x36 0x75 0x0d", "ef fd b6 f5 0d"),
        ("content_type 1", "01"),
        ("content_hash: 32 raw bytes", " 07" * 32),
    ],
)
record(
    "XFER_CHUNK",
    0x0011,
    {"transfer_id": 1, "offset": 0, "data": b"\x01\x02\x03\x04"},
    [("transfer_id 1, offset 0", "01 00"), ("data len 4", "04 01 02 03 04")],
)
record("XFER_END", 0x0012, {"transfer_id": 1}, [("transfer_id 1", "01")])
record("XFER_ABORT", 0x0013, {"transfer_id": 1, "reason": 2}, [("transfer_id 1, reason 2", "01 02")])
record(
    "STATE_SHIP",
    0x0014,
    {"envelope": b"\x09\x09\x09", "transfer_id": 1},
    [("envelope len 3", "03 09 09 09"), ("transfer_id 1", "01")],
)
record(
    "STATE_FETCH",
    0x0015,
    {"envelope": b"", "transfer_id": 2},
    [("envelope len 0", "00"), ("transfer_id 2", "02")],
)
record(
    "BLOB_FETCH",
    0x0016,
    {"content_hash": bytes(range(32))},
    [("content_hash 00 .. 1f, no length", " ".join(f"{i:02x}" for i in range(32)))],
)
record(
    "NODE_STATUS",
    0x0017,
    {
        "capacity": CAPACITY,
        "loadable_models": ["m"],
        "mem": {
            "allocated_bytes": 0,
            "host_retained_bytes": 0,
            "pool_blocks_total": 128,
            "pool_blocks_used": 5,
            "pool_bytes_evictable": 0,
            "tentative_bytes": 0,
        },
    },
    CAPACITY_PARTS
    + [
        ("loadable_models: 1 string, len 1, 'm'", "01 01 6d"),
        ("allocated 0, host_retained 0", "00 00"),
        ("pool_blocks_total 128", "80 01"),
        ("pool_blocks_used 5, evictable 0, tentative 0", "05 00 00"),
    ],
)
record(
    "GENERATE_CANCEL",
    0x0018,
    {"session_id": 55, "generation_id": 1},
    [("session_id 55, generation_id 1", "37 01")],
)
record(
    "STAGE_FORWARD_REQ",
    0x0019,
    {"request_id": 2, "tokens": [1, 128], "start_layer": 0, "end_layer": 12, "hidden_in": b"\xaa\xbb"},
    [
        ("request_id 2", "02"),
        ("tokens: 2, 1, 128", "02 01 80 01"),
        ("start_layer 0, end_layer 12", "00 0c"),
        ("hidden_in Some, len 2", "01 02 aa bb"),
    ],
)
record(
    "STAGE_FORWARD_REQ first stage",
    0x0019,
    {"request_id": 3, "tokens": [], "start_layer": 0, "end_layer": 24, "hidden_in": None},
    [("request_id 3, no tokens, layers 0 .. 24", "03 00 00 18"), ("hidden_in None", "00")],
)
record(
    "STAGE_FORWARD_RESP",
    0x001A,
    {"request_id": 2, "hidden": None, "token": 300},
    [("request_id 2", "02"), ("hidden None", "00"), ("token Some(300)", "01 ac 02")],
)
record(
    "STAGE_FORWARD_RESP empty",
    0x001A,
    {"request_id": 2, "hidden": None, "token": None},
    [("request_id 2, hidden None, token None", "02 00 00")],
)
record("TELEMETRY", 0x8001, {"spans": b"abc"}, [("spans len 3, 'abc'", "03 61 62 63")])
record("KEEPALIVE", 0x8002, {}, [("() is zero bytes", "")])


if __name__ == "__main__":
    out = Path(__file__).with_name("linkf.cbor")
    out.write_bytes(cbor2.dumps(RECORDS))
    print(f"wrote {len(RECORDS)} records to {out}")
