"""Which connections a node takes, and which it lets go to make room: bookkeeping only, no
sockets (`noded` closes what this says to close).

A connection is *pending* from its accept until the head's HELLO is answered, then *admitted*
until it ends. A flood of connections that never finish their handshake must not keep a real
head out, so when the pending slots are full the newcomer is taken and the oldest pending
connection is let go: a source at its own cap loses its oldest, otherwise the source holding
the most slots does. A real head, whose handshake takes milliseconds, always gets a slot that
lasts longer than its handshake; silent sockets only ever push each other out.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Generic, TypeVar

H = TypeVar("H")

#: Connections open at once (pending and admitted): each costs a thread and its buffers.
DEFAULT_MAX_CONNECTIONS = 256
#: Handshakes in progress at once, all sources together.
MAX_PENDING = 64
#: Handshakes in progress at once from one source address.
MAX_PENDING_PER_SOURCE = 16


@dataclass(frozen=True)
class Limits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_pending: int = MAX_PENDING
    max_pending_per_source: int = MAX_PENDING_PER_SOURCE


@dataclass
class Entry(Generic[H]):
    """One connection: `handle` is whatever the caller closes it by."""

    ticket: int
    source: str
    handle: H
    pending: bool = True


@dataclass
class Decision(Generic[H]):
    """What `admit` decided: the newcomer's ticket (None: refused, close it) and the pending
    connections to let go for it."""

    ticket: int | None
    evicted: list[Entry[H]] = field(default_factory=list)


class Admission(Generic[H]):
    """The node's connections by ticket; every method is safe to call from any thread."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._tickets = itertools.count(1)
        #: In arrival order, so the first pending entry of a source is its oldest.
        self._entries: dict[int, Entry[H]] = {}

    def admit(self, source: str, handle: H) -> Decision[H]:
        """Takes a new connection from `source` as pending, letting older pending ones go when
        the caps are reached; refuses it only when every open connection is past its HELLO."""
        with self._lock:
            evicted: list[Entry[H]] = []
            pending = [e for e in self._entries.values() if e.pending]
            from_source = [e for e in pending if e.source == source]
            if len(from_source) >= self.limits.max_pending_per_source:
                evicted.append(from_source[0])
            elif len(pending) >= self.limits.max_pending or len(self._entries) >= self.limits.max_connections:
                if not pending:
                    return Decision(None)
                evicted.append(self._oldest_of_busiest(pending))
            for e in evicted:
                del self._entries[e.ticket]
            if len(self._entries) >= self.limits.max_connections:
                return Decision(None, evicted)
            ticket = next(self._tickets)
            self._entries[ticket] = Entry(ticket, source, handle)
            return Decision(ticket, evicted)

    def hello(self, ticket: int) -> None:
        """The connection's HELLO is answered: it is no longer pending and cannot be let go."""
        with self._lock:
            entry = self._entries.get(ticket)
            if entry is not None:
                entry.pending = False

    def release(self, ticket: int) -> bool:
        """The connection ended; False when it had been let go already."""
        with self._lock:
            return self._entries.pop(ticket, None) is not None

    def handles(self) -> list[H]:
        """The handles of every open connection, to hang them all up."""
        with self._lock:
            return [e.handle for e in self._entries.values()]

    def counts(self) -> tuple[int, int]:
        """(open connections, of which pending)."""
        with self._lock:
            return len(self._entries), sum(e.pending for e in self._entries.values())

    @staticmethod
    def _oldest_of_busiest(pending: list[Entry[H]]) -> Entry[H]:
        busiest, _ = Counter(e.source for e in pending).most_common(1)[0]
        return next(e for e in pending if e.source == busiest)
