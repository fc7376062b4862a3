"""Helpers several test modules share: a session placed on a head, a greedy run on an engine."""

from __future__ import annotations

from conformance.head import FleetHead
from nodeagent.daemon import Daemon, GenExtras
from proto.params import GenParams


def placed(head: FleetHead, session_id: int, prompt: list[int], params: GenParams | None = None) -> int:
    """Assigns `session_id` on `head` and appends `prompt` to it; the epoch it was placed at."""
    epoch = head.assign(session_id, params or GenParams())
    head.append(session_id, prompt)
    return epoch


def greedy(daemon: Daemon, prompt: list[int], n: int) -> list[int]:
    """Up to `n` greedy tokens after `prompt`, straight from the engine."""
    result = daemon.generate_tokens_streaming(list(prompt), GenParams(), n, 0, GenExtras(), lambda batch: True)
    return list(result.tokens)
