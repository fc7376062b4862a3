"""Helpers several test modules share: a session placed on a head, a greedy run on an engine,
a GET of the node's HTTP side."""

from __future__ import annotations

import urllib.error
import urllib.request

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


def http_get(addr: str, path: str) -> tuple[int, str]:
    """The status and body `http://addr/path` answers, an error status included."""
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
