"""The handshake: the head's HELLO, the node's HELLO_ACK_F, and version negotiation.

`LinkFLimits` lives here rather than in `proto.linkf` (which re-exports it): HELLO_ACK_F carries
it, and `proto.linkf` imports this module for its catalog.
"""

import enum

from proto.postcard import U16, U32, U64, Bytes, Str, Tuple, Vec, struct

#: The longest frame a node reads before HELLO. HELLO holds two versions, a role and the fleet
#: token, a few dozen bytes; a peer that has not said who it is gets no 16 MiB buffer.
MAX_HELLO_FRAME = 16 * 1024


class LinkRole(enum.IntEnum):
    NodeAgent = 0
    Worker = 1
    HeadDaemon = 2


@struct
class Hello:
    proto_versions: Tuple[U16, U16]
    link_role: LinkRole
    auth: Bytes


@struct
class CapacitySummary:
    gpu_memory_bytes: U64
    gpu_memory_free_bytes: U64
    host_memory_bytes: U64
    active_sessions: U32
    max_sessions: U32
    max_context_tokens: U64
    kv_blocks_used: U64
    kv_blocks_total: U64
    lanes_active: U32
    max_lanes: U32
    queue_depth: U32
    decode_tokens_per_s: U32
    prefill_tokens_per_s: U32
    sampled_at_ms: U64


@struct
class LinkFLimits:
    max_frame: U32
    transfer_window: U32
    max_transfer: U64
    transfer_budget: U64


@struct
class HelloAckF:
    chosen_version: U16
    node_identity: Str
    capacity: CapacitySummary
    loadable_models: Vec[Str]
    feature_flags: U64
    limits: LinkFLimits


def negotiate(offered: tuple[int, int], supported: tuple[int, int]) -> int | None:
    """The highest version both `(lo, hi)` ranges hold, or None when they do not overlap."""
    lo = max(offered[0], supported[0])
    hi = min(offered[1], supported[1])
    return hi if lo <= hi else None
