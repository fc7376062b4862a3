"""Transitional: the test head is the conformance kit's `FleetHead` now; import from
`conformance` (this module goes once no test imports it)."""

from conformance.head import LEASE, TIMEOUT, Generation, HeadTimeout, Received
from conformance.head import FleetHead as Head
from conformance.raw import hung_up, raw_connect, raw_frame
from conformance.reference import MOCK_LAYERS, MOCK_VOCAB, mock_stage, mock_tokens

__all__ = [
    "LEASE",
    "MOCK_LAYERS",
    "MOCK_VOCAB",
    "TIMEOUT",
    "Generation",
    "Head",
    "HeadTimeout",
    "Received",
    "hung_up",
    "mock_stage",
    "mock_tokens",
    "raw_connect",
    "raw_frame",
]
