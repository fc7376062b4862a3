"""What the node reports about itself as it serves: the narrow interface between the serve loop
and whatever watches it (Prometheus metrics, the story lines in the log).

The agent and the accept loop call these methods at the moments an operator cares about and
nothing more; counting, timing and wording live with the observers, so the serve loop stays the
Rust node's. Every method may be called from any thread and must return quickly: it runs on a
connection's loop.
"""

from __future__ import annotations

import threading

from linkf.errors import Closed, Envelope, Payload, Protocol, TimedOut, Unauthorized
from proto import finish

#: Finish codes as the metrics label and the log name them.
finish_name = finish.name


class GenerationWatch:
    """One generation as its observers follow it; the agent keeps it with the generation."""

    def tokens_sent(self, count: int) -> None:
        """`count` tokens left for the head in one TOKEN_EVENTS."""

    def finished(self, reason: int) -> None:
        """The generation's Finish went out with `reason` (a finish code)."""

    def dropped(self) -> None:
        """The connection let go of the generation: after its Finish, or with none sent (the
        link or the session went away first)."""


class NodeObserver:
    """The events of one node. This base observes nothing: a node without `--metrics-listen`
    pays one no-op call per event."""

    def node_state(self, state: str) -> None:
        """The node is `loading`, `serving` or `draining`."""

    def connection_opened(self, peer: str) -> None:
        """A head's connection passed its handshake and HELLO."""

    def connection_closed(self, peer: str, reason: str) -> None:
        """A connection that was opened ended, for `reason` (a short phrase)."""

    def handshake_refused(self, peer: str, reason: str) -> None:
        """A connection ended before its HELLO was answered; `reason` is one of
        `REFUSAL_REASONS`."""

    def session_assigned(self, session_id: int, epoch: int) -> None:
        """The head placed a session here (or placed it again at a newer epoch)."""

    def session_revoked(self, session_id: int) -> None:
        """The head took a session away."""

    def session_fenced(self, session_id: int) -> None:
        """A session's lease ran out and the node fenced it itself."""

    def generation_started(self, session_id: int, generation_id: int, prompt_tokens: int) -> GenerationWatch:
        """A generation was accepted with a context of `prompt_tokens`; returns its watch."""
        return GenerationWatch()

    def generation_declined(self, session_id: int, generation_id: int) -> None:
        """A GENERATE_REQ was answered with FINISH_DECLINED and never ran."""

    def stage_forwarded(self, ran: bool) -> None:
        """A stage forward was answered; `ran` is False when it was answered empty."""


#: Why a connection ended before its HELLO was answered, as metrics label it.
REFUSAL_REASONS = ("token", "timeout", "not_linkf", "protocol", "closed", "io")


def refusal_reason(error: BaseException | None) -> str:
    """The label of what ended a connection before its HELLO (None: the agent dropped a peer
    that sent no HELLO in time)."""
    if error is None or isinstance(error, TimedOut):
        return "timeout"
    if isinstance(error, Unauthorized):
        return "token"
    if isinstance(error, Closed):
        return "closed"
    if isinstance(error, (Envelope, Payload)):
        return "not_linkf"
    if isinstance(error, Protocol):
        return "protocol"
    return "io"


def close_reason(error: BaseException | None) -> str:
    """What ended an opened connection, in a few words for the log."""
    if error is None:
        return "the head left, or went quiet and the node let it go"
    if isinstance(error, Closed):
        return "the head closed it"
    return str(error) or type(error).__name__


class Observers(NodeObserver):
    """Several observers as one, in order; the serving loops talk to this one.

    It also tells the ends of connections apart: the loop that owns a connection reports how it
    ended (`ended`), and a connection never opened (no HELLO answered) counts as a refused
    handshake, one that was opened as closed."""

    def __init__(self, *observers: NodeObserver) -> None:
        self.observers = observers
        self._open: set[str] = set()
        self._lock = threading.Lock()

    def ended(self, peer: str, error: BaseException | None) -> None:
        """The connection from `peer` is over; `error` is what its serve raised, if anything."""
        with self._lock:
            opened = peer in self._open
            self._open.discard(peer)
        if opened:
            self.connection_closed(peer, close_reason(error))
        else:
            self.handshake_refused(peer, refusal_reason(error))

    def node_state(self, state: str) -> None:
        for o in self.observers:
            o.node_state(state)

    def connection_opened(self, peer: str) -> None:
        with self._lock:
            self._open.add(peer)
        for o in self.observers:
            o.connection_opened(peer)

    def connection_closed(self, peer: str, reason: str) -> None:
        for o in self.observers:
            o.connection_closed(peer, reason)

    def handshake_refused(self, peer: str, reason: str) -> None:
        for o in self.observers:
            o.handshake_refused(peer, reason)

    def session_assigned(self, session_id: int, epoch: int) -> None:
        for o in self.observers:
            o.session_assigned(session_id, epoch)

    def session_revoked(self, session_id: int) -> None:
        for o in self.observers:
            o.session_revoked(session_id)

    def session_fenced(self, session_id: int) -> None:
        for o in self.observers:
            o.session_fenced(session_id)

    def generation_started(self, session_id: int, generation_id: int, prompt_tokens: int) -> GenerationWatch:
        return _Watches([o.generation_started(session_id, generation_id, prompt_tokens) for o in self.observers])

    def generation_declined(self, session_id: int, generation_id: int) -> None:
        for o in self.observers:
            o.generation_declined(session_id, generation_id)

    def stage_forwarded(self, ran: bool) -> None:
        for o in self.observers:
            o.stage_forwarded(ran)


class _Watches(GenerationWatch):
    def __init__(self, watches: list[GenerationWatch]) -> None:
        self.watches = watches

    def tokens_sent(self, count: int) -> None:
        for w in self.watches:
            w.tokens_sent(count)

    def finished(self, reason: int) -> None:
        for w in self.watches:
            w.finished(reason)

    def dropped(self) -> None:
        for w in self.watches:
            w.dropped()
