"""The head's write-ahead log, reduced to what a check needs: every committed token event, per
session, in commit order. A head commits into it through `HeadSession`'s `commit` callback; the
node never uses it, so it lives in the kit rather than in `linkf`."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from proto.linkf import TokenEvent


@dataclass(frozen=True)
class CommittedEvent:
    committed_id: int
    event: TokenEvent


class WalStub:
    def __init__(self) -> None:
        self._sessions: dict[int, list[CommittedEvent]] = defaultdict(list)

    def commit(self, event: TokenEvent) -> int:
        """Appends ``event`` to its session's log; returns its position there."""
        log = self._sessions[event.session_id]
        log.append(CommittedEvent(len(log), event))
        return len(log) - 1

    def session_events(self, session_id: int) -> list[CommittedEvent]:
        return list(self._sessions.get(session_id, ()))

    def generation_events(self, session_id: int, epoch: int, generation_id: int) -> list[TokenEvent]:
        """One generation's committed events, in commit order."""
        return [
            c.event
            for c in self._sessions.get(session_id, ())
            if c.event.epoch == epoch and c.event.generation_id == generation_id
        ]

    def total_committed(self) -> int:
        return sum(len(log) for log in self._sessions.values())

    def assert_single_contiguous_streams(self) -> None:
        """Fails unless every generation's committed ``event_seq``s are exactly 0, 1, 2, …:
        a gap or a duplicate means the dedup let something through."""
        seqs: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for log in self._sessions.values():
            for c in log:
                e = c.event
                seqs[(e.session_id, e.epoch, e.generation_id)].append(e.event_seq)
        for (s, epoch, g), got in sorted(seqs.items()):
            if sorted(got) != list(range(len(got))):
                raise AssertionError(
                    f"session {s} epoch {epoch} generation {g}: committed stream has a gap or duplicate: {sorted(got)}"
                )
