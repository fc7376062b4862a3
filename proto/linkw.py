"""The one Link W type Link F carries: a worker's memory counters, inside NODE_STATUS."""

from proto.postcard import U64, struct


@struct
class MemCountersMsg:
    allocated_bytes: U64
    host_retained_bytes: U64
    pool_blocks_total: U64
    pool_blocks_used: U64
    pool_bytes_evictable: U64
    tentative_bytes: U64
