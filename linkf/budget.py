"""One budget for the bytes every endpoint of a process holds for frames not yet complete.

A frame may legally be 16 MiB, and its bytes sit in the reader's buffer until the last one
arrives; forty peers sending such frames slowly held 682 MB. Each endpoint's ``Holding`` says,
after each read, how many bytes the frame it is receiving takes once whole (as its header
announces), and the holding that would take the process past the budget is refused: its
endpoint fails that link (``Envelope``), the others go on. Reserving the whole frame at its
header means a frame let start always finishes.
"""

from __future__ import annotations

import threading

#: Bytes all endpoints together may hold for incomplete frames: eight whole 16 MiB frames.
DEFAULT_BUDGET = 128 * 1024 * 1024


class BufferBudget:
    """A process-wide count of held bytes against a limit; safe to share between threads."""

    def __init__(self, limit: int = DEFAULT_BUDGET) -> None:
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    def held(self) -> int:
        return self._held

    def holding(self) -> Holding:
        """A fresh account, holding nothing, for one endpoint."""
        return Holding(self)

    def _change(self, delta: int) -> bool:
        """Adds `delta`; a growth that would pass the limit is refused and changes nothing."""
        with self._lock:
            if delta > 0 and self._held + delta > self.limit:
                return False
            self._held += delta
            return True


class Holding:
    """What one endpoint holds of its budget."""

    def __init__(self, budget: BufferBudget) -> None:
        self._budget = budget
        self.bytes = 0

    def hold(self, n: int) -> bool:
        """Now holds `n` bytes; False (still holding the old amount) when that passes the budget."""
        if not self._budget._change(n - self.bytes):
            return False
        self.bytes = n
        return True

    def release(self) -> None:
        self.hold(0)


#: The budget every endpoint shares unless it is given another.
PROCESS_BUDGET = BufferBudget()
