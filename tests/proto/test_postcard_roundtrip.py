"""The proto crate's tests/postcard_roundtrip.rs, ported for its Link F and handshake messages.

The Link W messages of that file (tick plans, strategies, state sync, transcription) are not part
of this port.
"""

from proto.handshake import CapacitySummary, Hello, HelloAckF, LinkFLimits, LinkRole
from proto.linkf import (
    GenerationWatermark,
    Lease,
    LeaseStateMsg,
    ReconcileAckMsg,
    ReconcileMsg,
    RetryRange,
    SegmentKind,
    SessionAssignMsg,
    SessionReconcileAck,
    SessionReconcileState,
    StateShipMsg,
    TokenEvent,
    TokenEventPayload,
    TokenEventsMsg,
    UsageMsg,
    XferBeginMsg,
    XferChunkMsg,
)
from proto.postcard import from_bytes, to_bytes

MAX_FRAME_TEST = 16 * 1024 * 1024


def roundtrip(value):
    return from_bytes(type(value), to_bytes(value))


def test_session_assign_roundtrips():
    msg = SessionAssignMsg(
        command_id=1001,
        session_id=55,
        epoch=3,
        lease=Lease(duration_ms=30_000, renew_by_ms=20_000),
        codec="anthropic-messages",
        params=bytes([9, 9, 9]),
        qos_class=1,
        policy_ref=42,
    )
    assert roundtrip(msg) == msg


def test_token_events_roundtrips_all_payload_kinds():
    payloads = [
        TokenEventPayload.Tokens(tokens=[10, 20, 30]),
        TokenEventPayload.Segment(kind=SegmentKind.TextDelta, data=b"hello"),
        TokenEventPayload.Usage(usage=UsageMsg(input_tokens=12, output_tokens=34)),
        TokenEventPayload.Finish(reason=1),
    ]
    msg = TokenEventsMsg(
        events=[TokenEvent(session_id=1, epoch=1, generation_id=1, event_seq=i, payload=p) for i, p in enumerate(payloads)]
    )
    got = roundtrip(msg)
    assert got == msg
    assert isinstance(got.events[3].payload, TokenEventPayload.Finish)
    assert got.events[1].payload.kind is SegmentKind.TextDelta


def test_reconcile_and_reconcile_ack_roundtrip():
    lease = Lease(duration_ms=10_000, renew_by_ms=8_000)
    reconcile = ReconcileMsg(
        sessions=[
            SessionReconcileState(
                session_id=1,
                epoch=4,
                lease_state=LeaseStateMsg(lease=lease, elapsed_ms=1_000),
                command_watermark=500,
                generation_watermarks=[GenerationWatermark(generation_id=1, watermark=100)],
            )
        ]
    )
    assert roundtrip(reconcile) == reconcile
    ack = ReconcileAckMsg(
        sessions=[
            SessionReconcileAck(
                session_id=1,
                held=True,
                retry_ranges=[RetryRange(generation_id=1, from_seq=90, to_seq=100)],
                lease_view=LeaseStateMsg(lease=lease, elapsed_ms=1_500),
            )
        ]
    )
    assert roundtrip(ack) == ack


def test_xfer_and_state_ship_roundtrip():
    begin = XferBeginMsg(transfer_id=1, total_len=4096, checksum=0xDEAD_BEEF, content_type=1, content_hash=bytes([7] * 32))
    assert roundtrip(begin) == begin
    chunk = XferChunkMsg(transfer_id=1, offset=0, data=bytes([1, 2, 3, 4]))
    assert roundtrip(chunk) == chunk
    ship = StateShipMsg(envelope=bytes([9, 9, 9]), transfer_id=1)
    assert roundtrip(ship) == ship


def test_handshake_hello_and_ack_roundtrip():
    hello = Hello(proto_versions=(1, 3), link_role=LinkRole.NodeAgent, auth=bytes([1, 2, 3]))
    assert roundtrip(hello) == hello
    ack = HelloAckF(
        chosen_version=3,
        node_identity="node-a",
        capacity=CapacitySummary(
            gpu_memory_bytes=1 << 34,
            gpu_memory_free_bytes=1 << 30,
            host_memory_bytes=1 << 36,
            active_sessions=2,
            max_sessions=16,
            max_context_tokens=4096,
        ),
        loadable_models=["glm-5.2"],
        feature_flags=0,
        limits=LinkFLimits(max_frame=MAX_FRAME_TEST, transfer_window=4, max_transfer=1 << 30, transfer_budget=1 << 31),
    )
    assert roundtrip(ack) == ack
