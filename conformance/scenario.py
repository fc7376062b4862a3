"""What a scenario is and what it gets: the node under test, fresh session ids, heads that are
closed after it, and the two ways it can end other than passing (`Violation`, `Skipped`).

Scenarios register themselves with `@scenario(...)` in the `checks_*` modules; `suite` runs them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from conformance.head import GREEDY, LEASE, FleetHead, clock_id
from conformance.raw import RawLink
from proto.handshake import HelloAckF
from proto.linkf import Lease
from proto.params import GenParams


class Violation(Exception):
    """The node broke a rule; the message says which and how."""


class Skipped(Exception):
    """The scenario does not apply to this node (no token, not the mock, ...)."""


@dataclass(frozen=True)
class Target:
    """The node under test. `mock`: it serves the fleet mock, so outputs are checked token for
    token against the kit's reference. `timeout`: the longest any single wait lasts."""

    addr: str
    auth: bytes = b""
    mock: bool = False
    timeout: float = 10.0


@dataclass
class Context:
    """One scenario's view of the node; `close()` hangs up every link it opened."""

    target: Target
    hello: HelloAckF
    _ids: itertools.count = field(default_factory=lambda: itertools.count(clock_id()))
    _heads: list[FleetHead] = field(default_factory=list)
    _links: list[RawLink] = field(default_factory=list)

    def head(self, **kw) -> FleetHead:
        """A head connected to the node with the target's token (unless `auth` is given)."""
        kw.setdefault("auth", self.target.auth)
        kw.setdefault("timeout", self.target.timeout)
        head = FleetHead.connect(self.target.addr, **kw)
        self._heads.append(head)
        return head

    def raw(self, **kw) -> RawLink:
        """A link for bytes, Noise-wrapped with the target's token (unless `auth` is given)."""
        kw.setdefault("auth", self.target.auth)
        link = RawLink.connect(self.target.addr, kw.pop("auth"), timeout=self.target.timeout, **kw)
        self._links.append(link)
        return link

    def session(self) -> int:
        """A session id no other scenario, or earlier run of the suite, used."""
        return next(self._ids)

    def place(
        self, head: FleetHead, prompt: list[int], params: GenParams = GREEDY, lease: Lease = LEASE
    ) -> tuple[int, int]:
        """Places a fresh session holding `prompt`; (session id, epoch)."""
        session = self.session()
        epoch = head.assign(session, params, lease)
        head.append(session, prompt)
        return session, epoch

    @property
    def window(self) -> int:
        """The node's context window as it announced it (0 = unknown)."""
        return self.hello.capacity.max_context_tokens

    def close(self) -> None:
        for head in self._heads:
            head.close()
        for link in self._links:
            link.close()


def check(condition: object, why: str) -> None:
    """A rule of the protocol: `why` says what the node did instead."""
    if not condition:
        raise Violation(why)


def skip(why: str) -> None:
    raise Skipped(why)


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Context], None]
    #: What it checks, for the table and the junit file.
    doc: str
    #: Needs the fleet mock (token-exact checks).
    mock: bool = False


#: Every scenario, in the order they run.
SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, *, mock: bool = False) -> Callable[[Callable[[Context], None]], Callable[[Context], None]]:
    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        if name in SCENARIOS:
            raise ValueError(f"two scenarios are named {name}")
        SCENARIOS[name] = Scenario(name, fn, (fn.__doc__ or "").strip().split("\n")[0], mock)
        return fn

    return register
