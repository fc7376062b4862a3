"""The node's story at `info`: what an operator wants to read in the log without turning debug
on. One line per connection opened or closed (peer, reason), per session assigned or revoked
(a fenced one has the agent's own warning), per generation finished (session, tokens, tok/s,
finish reason), and a status line every `STATUS_EVERY_S` while generations run.
"""

from __future__ import annotations

import logging
import threading
import time

from nodeagent.daemon import Daemon
from nodeagent.logs import fields
from nodeagent.observe import GenerationWatch, NodeObserver, finish_name

log = logging.getLogger("nodeagent.story")

STATUS_EVERY_S = 10.0


class StoryLog(NodeObserver):
    """Logs the node's events at `info` (a refused handshake at `warn`)."""

    def __init__(self, daemon: Daemon, max_lanes: int, status_every_s: float = STATUS_EVERY_S) -> None:
        self.daemon = daemon
        self.max_lanes = max_lanes
        self.status_every_s = status_every_s
        self._running = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="node-status-line", daemon=True)
        self._ticker.start()

    def close(self) -> None:
        self._stop.set()

    def connection_opened(self, peer: str) -> None:
        log.info("head connected", extra=fields(peer=peer))

    def connection_closed(self, peer: str, reason: str) -> None:
        log.info("head connection closed", extra=fields(peer=peer, reason=reason))

    def handshake_refused(self, peer: str, reason: str) -> None:
        log.warning("connection refused before its HELLO", extra=fields(peer=peer, reason=reason))

    def session_assigned(self, session_id: int, epoch: int) -> None:
        log.info("session assigned", extra=fields(session=session_id, epoch=epoch))

    def session_revoked(self, session_id: int) -> None:
        log.info("session revoked", extra=fields(session=session_id))

    def generation_started(self, session_id: int, generation_id: int, prompt_tokens: int) -> GenerationWatch:
        with self._lock:
            self._running += 1
        return _Finishing(self, session_id, generation_id)

    def _ended(self) -> None:
        with self._lock:
            self._running -= 1

    def _tick(self) -> None:
        """The status line, while generations run: what a glance at a dashboard would give. The
        rate is the engine's decode counter over the interval, so sending tokens costs the
        story nothing."""
        last_tokens, last_at = self.daemon.sched_stats().decode_tokens, time.monotonic()
        while not self._stop.wait(self.status_every_s):
            stats = self.daemon.sched_stats()
            with self._lock:
                running = self._running
            tokens, now = stats.decode_tokens, time.monotonic()
            if running:
                log.info(
                    "busy",
                    extra=fields(
                        generations=running,
                        lanes=f"{stats.lanes_active}/{self.max_lanes}",
                        queued=sum(stats.queue_depth),
                        kv_blocks=f"{stats.pool_blocks_used}/{stats.pool_blocks_total}",
                        decode_tokens_per_s=round((tokens - last_tokens) / (now - last_at), 1),
                    ),
                )
            last_tokens, last_at = tokens, now


class _Finishing(GenerationWatch):
    def __init__(self, story: StoryLog, session_id: int, generation_id: int) -> None:
        self.story = story
        self.session_id = session_id
        self.generation_id = generation_id
        self.started = time.monotonic()
        self.tokens = 0
        self.running = True

    def tokens_sent(self, count: int) -> None:
        self.tokens += count

    def dropped(self) -> None:
        if self.running:
            self.running = False
            self.story._ended()

    def finished(self, reason: int) -> None:
        seconds = time.monotonic() - self.started
        self.dropped()
        log.info(
            "generation finished",
            extra=fields(
                session=self.session_id,
                generation=self.generation_id,
                tokens=self.tokens,
                tokens_per_s=round(self.tokens / seconds, 1) if seconds > 0 else 0.0,
                reason=finish_name(reason),
            ),
        )
