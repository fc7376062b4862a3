"""Finish reasons of the engine ABI (`superfluid_abi::finish`), carried in a Finish event.

The node agent adds its own three above these (see `nodeagent.agent`).
"""

NONE = 0
EOS = 1
LENGTH = 2
GRAMMAR = 3
CANCELLED = 4
ERROR = 5
