"""The Link F catalog: message types and their payloads (linkf-wire.md §3)."""

import enum
from dataclasses import dataclass
from typing import Any

from proto.handshake import CapacitySummary, Hello, HelloAckF
from proto.handshake import LinkFLimits as LinkFLimits  # Rust's linkf::LinkFLimits, re-exported
from proto.linkw import MemCountersMsg
from proto.postcard import (
    U8,
    U32,
    U64,
    Array32,
    Bool,
    Bytes,
    Option,
    PostcardError,
    Str,
    Vec,
    data_enum,
    from_bytes,
    struct,
)

# Nested types


@struct
class Lease:
    duration_ms: U64
    renew_by_ms: U64


@struct
class LeaseStateMsg:
    lease: Lease
    elapsed_ms: U64


@struct
class GenerationWatermark:
    generation_id: U64
    watermark: Option[U64]


@struct
class SessionReconcileState:
    session_id: U64
    epoch: U64
    lease_state: LeaseStateMsg
    command_watermark: U64
    generation_watermarks: Vec[GenerationWatermark]


@struct
class RetryRange:
    """Token events `from_seq ..= to_seq` (inclusive) of one generation, to send again."""

    generation_id: U64
    from_seq: U64
    to_seq: U64


@struct
class SessionReconcileAck:
    session_id: U64
    held: Bool
    retry_ranges: Vec[RetryRange]
    lease_view: LeaseStateMsg


@struct
class TokenSpan:
    start: U64
    end: U64


@struct
class GenerationBudgetsMsg:
    max_new_tokens: U64
    max_wall_ms: U64


class SegmentKind(enum.IntEnum):
    TextDelta = 0
    ReasoningDelta = 1
    ToolCallDelta = 2


@struct
class UsageMsg:
    input_tokens: U64
    output_tokens: U64


@data_enum
class TokenEventPayload:
    """What one token event carries; `Tokens` and `Usage` are newtype variants."""

    @struct
    class Tokens:
        tokens: Vec[U32]

    @struct
    class Segment:
        kind: SegmentKind
        data: Bytes

    @struct
    class Usage:
        usage: UsageMsg

    @struct
    class Finish:
        reason: U32


#: A `TokenEventPayload` value, any of its variants: the type of a field holding one (the
#: variants are not subclasses of the enum's class).
AnyTokenEventPayload = (
    TokenEventPayload.Tokens | TokenEventPayload.Segment | TokenEventPayload.Usage | TokenEventPayload.Finish
)


@struct
class TokenEvent:
    session_id: U64
    epoch: U64
    generation_id: U64
    event_seq: U64
    payload: AnyTokenEventPayload


# Payloads, in msg_type order


@struct
class ReconcileMsg:
    sessions: Vec[SessionReconcileState]


@struct
class ReconcileAckMsg:
    sessions: Vec[SessionReconcileAck]


@struct
class SessionAssignMsg:
    """`params` holds a postcard `GenParams` (see `proto.fleet`)."""

    command_id: U64
    session_id: U64
    epoch: U64
    lease: Lease
    codec: Str
    params: Bytes
    qos_class: U8
    policy_ref: U64


@struct
class SessionRevokeMsg:
    command_id: U64
    session_id: U64
    epoch: U64


@struct
class PolicyUpdateMsg:
    policy_version: U64
    envelope: Bytes


@struct
class LeaseRenewMsg:
    session_id: U64
    epoch: U64


@struct
class LeaseGrantMsg:
    session_id: U64
    epoch: U64
    duration_ms: U64
    renew_by_ms: U64


@struct
class AppendContentMsg:
    """`blocks` holds a postcard `Vec<u32>`: the session's whole context."""

    command_id: U64
    session_id: U64
    epoch: U64
    blocks: Bytes
    spans: Vec[TokenSpan]
    media_refs: Vec[Array32]


@struct
class GenerateReqMsg:
    command_id: U64
    session_id: U64
    epoch: U64
    generation_id: U64
    budgets: GenerationBudgetsMsg
    policy_ref: U64


@struct
class ParkReqMsg:
    command_id: U64
    session_id: U64
    epoch: U64
    generation_id: U64


@struct
class ResumeReqMsg:
    command_id: U64
    session_id: U64
    epoch: U64
    generation_id: U64
    budgets: GenerationBudgetsMsg
    policy_ref: U64


@struct
class TokenEventsMsg:
    events: Vec[TokenEvent]


@struct
class WatermarkAckMsg:
    session_id: U64
    epoch: U64
    generation_id: U64
    watermark: U64


@struct
class XferBeginMsg:
    transfer_id: U64
    total_len: U64
    checksum: U64
    content_type: U32
    content_hash: Array32


@struct
class XferChunkMsg:
    transfer_id: U64
    offset: U64
    data: Bytes


@struct
class XferEndMsg:
    transfer_id: U64


@struct
class XferAbortMsg:
    transfer_id: U64
    reason: U32


@struct
class StateShipMsg:
    envelope: Bytes
    transfer_id: U64


@struct
class StateFetchMsg:
    envelope: Bytes
    transfer_id: U64


@struct
class BlobFetchMsg:
    content_hash: Array32


@struct
class NodeStatusMsg:
    capacity: CapacitySummary
    loadable_models: Vec[Str]
    mem: MemCountersMsg


@struct
class GenerateCancelMsg:
    session_id: U64
    generation_id: U64


@struct
class StageForwardReqMsg:
    request_id: U64
    tokens: Vec[U32]
    start_layer: U32
    end_layer: U32
    hidden_in: Option[Bytes]


@struct
class StageForwardRespMsg:
    request_id: U64
    hidden: Option[Bytes]
    token: Option[U32]


@struct
class TelemetryMsg:
    spans: Bytes


@dataclass
class KeepAlive:
    """KEEPALIVE's payload, Rust's `()`: a struct with no fields, written as zero bytes."""


class MsgType(enum.IntEnum):
    """The `msg_type` of each Link F frame, and `payload`, the class its payload decodes as.
    Those with bit 15 set are droppable."""

    payload: type

    def __new__(cls, code: int, payload: type) -> "MsgType":
        member = int.__new__(cls, code)
        member._value_ = code
        member.payload = payload
        return member

    HELLO = 0x0001, Hello
    HELLO_ACK_F = 0x0002, HelloAckF
    RECONCILE = 0x0003, ReconcileMsg
    RECONCILE_ACK = 0x0004, ReconcileAckMsg
    SESSION_ASSIGN = 0x0005, SessionAssignMsg
    SESSION_REVOKE = 0x0006, SessionRevokeMsg
    POLICY_UPDATE = 0x0007, PolicyUpdateMsg
    LEASE_RENEW = 0x0008, LeaseRenewMsg
    LEASE_GRANT = 0x0009, LeaseGrantMsg
    APPEND_CONTENT = 0x000A, AppendContentMsg
    GENERATE_REQ = 0x000B, GenerateReqMsg
    PARK_REQ = 0x000C, ParkReqMsg
    RESUME_REQ = 0x000D, ResumeReqMsg
    TOKEN_EVENTS = 0x000E, TokenEventsMsg
    WATERMARK_ACK = 0x000F, WatermarkAckMsg
    XFER_BEGIN = 0x0010, XferBeginMsg
    XFER_CHUNK = 0x0011, XferChunkMsg
    XFER_END = 0x0012, XferEndMsg
    XFER_ABORT = 0x0013, XferAbortMsg
    STATE_SHIP = 0x0014, StateShipMsg
    STATE_FETCH = 0x0015, StateFetchMsg
    BLOB_FETCH = 0x0016, BlobFetchMsg
    NODE_STATUS = 0x0017, NodeStatusMsg
    GENERATE_CANCEL = 0x0018, GenerateCancelMsg
    STAGE_FORWARD_REQ = 0x0019, StageForwardReqMsg
    STAGE_FORWARD_RESP = 0x001A, StageForwardRespMsg
    TELEMETRY = 0x8001, TelemetryMsg
    KEEPALIVE = 0x8002, KeepAlive


#: The name the Rust crate gives the catalog (`msg_type::NODE_STATUS`).
msg_type = MsgType

ALL = tuple(MsgType)
PAYLOAD_TYPES: dict[int, type] = {t: t.payload for t in MsgType}
_KNOWN = frozenset(MsgType)
_NAMES: dict[int, str] = {t: t.name for t in MsgType}


def is_known_type(t: int) -> bool:
    return t in _KNOWN


def type_name(t: int) -> str:
    """A `msg_type` as people read it: `TOKEN_EVENTS`, or `0x0100` for one not in the catalog."""
    return _NAMES.get(t, f"0x{t:04x}")


def decode_payload(t: int, payload: bytes) -> Any:
    """The payload of a frame of type `t`; an unknown type is a `PostcardError` too."""
    cls = PAYLOAD_TYPES.get(t)
    if cls is None:
        raise PostcardError(f"unknown msg_type 0x{t:04x}")
    return from_bytes(cls, payload)
