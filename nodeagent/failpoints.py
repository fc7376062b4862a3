"""Failpoints: faults a test asks the engine to make, as etcd's gofail does.

`SUPERFLUID_FAILPOINTS` is read once, when the engine starts; it holds a comma-separated list
of `NAME=ACTION@N`, each firing at the Nth time the engine passes that point:

- `engine.step=hang@N`: the Nth decode step never returns;
- `engine.step=raise@N`: the Nth decode step raises;
- `engine.step=sleep(MS)@N`: the Nth decode step takes MS milliseconds longer, then goes on;
- `engine.scheduler=die@N`: the scheduler thread dies at its Nth iteration;
- `engine.alloc=oom@N`: the Nth KV block allocation fails as a CUDA out-of-memory would.

Unset, there is no `Failpoints` object at all and the engine's only cost is a test of None.
"""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

ENV = "SUPERFLUID_FAILPOINTS"

STEP = "engine.step"
SCHEDULER = "engine.scheduler"
ALLOC = "engine.alloc"


class Action(StrEnum):
    HANG = "hang"
    RAISE = "raise"
    SLEEP = "sleep"
    DIE = "die"
    OOM = "oom"


#: What each point can be made to do.
ACTIONS: dict[str, frozenset[Action]] = {
    STEP: frozenset({Action.HANG, Action.RAISE, Action.SLEEP}),
    SCHEDULER: frozenset({Action.DIE}),
    ALLOC: frozenset({Action.OOM}),
}

_SPEC = re.compile(r"(?P<name>[a-z.]+)=(?P<action>[a-z]+)(?:\((?P<ms>\d+)\))?@(?P<at>[1-9]\d*)")


class FailpointSpecError(ValueError):
    """`SUPERFLUID_FAILPOINTS` does not parse; the message names the entry and why."""


class InjectedFault(RuntimeError):
    """The fault a `raise` or `die` failpoint makes."""


@dataclass(frozen=True)
class Failpoint:
    name: str
    action: Action
    at: int
    #: How long a `sleep` lasts.
    ms: int = 0

    def __str__(self) -> str:
        sleep = f"({self.ms})" if self.action == Action.SLEEP else ""
        return f"{self.name}={self.action}{sleep}@{self.at}"


class Failpoints:
    """The armed failpoints and how often each point has been passed; any thread may `hit`."""

    def __init__(self, points: list[Failpoint]) -> None:
        self.points = points
        self._passes: Counter[str] = Counter()
        self._lock = threading.Lock()

    def hit(self, name: str) -> Failpoint | None:
        """Counts one pass of point `name`; the failpoint that fires on this pass, if any."""
        with self._lock:
            self._passes[name] += 1
            n = self._passes[name]
        return next((p for p in self.points if p.name == name and p.at == n), None)

    def __str__(self) -> str:
        return ",".join(map(str, self.points))


def parse(spec: str) -> Failpoints:
    """`spec` as `SUPERFLUID_FAILPOINTS` holds it; raises FailpointSpecError."""
    return Failpoints([_parse_one(entry.strip()) for entry in spec.split(",") if entry.strip()])


def _parse_one(entry: str) -> Failpoint:
    m = _SPEC.fullmatch(entry)
    if m is None:
        raise FailpointSpecError(f"{ENV}: {entry!r} is not NAME=ACTION@N (N from 1)")
    name, action, ms = m["name"], m["action"], m["ms"]
    if name not in ACTIONS:
        raise FailpointSpecError(f"{ENV}: unknown failpoint {name!r}; expected one of {', '.join(ACTIONS)}")
    if action not in {a.value for a in ACTIONS[name]}:
        allowed = ", ".join(sorted(ACTIONS[name]))
        raise FailpointSpecError(f"{ENV}: {name} cannot {action!r}; it can {allowed}")
    if (action == Action.SLEEP) != (ms is not None):
        raise FailpointSpecError(f"{ENV}: {entry!r}: sleep takes its milliseconds, as sleep(500); no other action does")
    return Failpoint(name, Action(action), int(m["at"]), int(ms or 0))


def from_env(env: Mapping[str, str] = os.environ) -> Failpoints | None:
    """The failpoints `SUPERFLUID_FAILPOINTS` arms; None when it is unset or empty."""
    spec = env.get(ENV, "")
    return parse(spec) if spec.strip() else None
