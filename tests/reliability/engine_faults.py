"""The engine-faults rows of `make reliability`: a `--model builtin` node process with one
failpoint armed (SUPERFLUID_FAILPOINTS), heads generating through the kit, and `/health`
polled all along. Each row checks what docs/hardening.md promises for its fault: what the heads
see, the health transitions, that no generation on a healthy lane is lost or changed, and that
the node recovers or exits as documented. Tokens are checked against the builtin model run in
this process, one lane at a time."""

from __future__ import annotations

import functools
import re
import threading
import time
import urllib.error
import urllib.request

from harness import Measured, Row, WatchedNode
from polling import background

from conformance.head import FleetHead, Generation
from proto import finish

STALL_MS = 1000
DRAIN_MS = 5000
BUILTIN = (
    "--listen", "127.0.0.1:0", "--model", "builtin", "--metrics-listen", "127.0.0.1:0",
    "--engine-stall-timeout-ms", str(STALL_MS), "--drain-timeout-ms", str(DRAIN_MS),
)
METRICS_AT = r"metrics at http://(\S+)/metrics"
#: The warm-up before the baseline: one prefill, 7 decode steps, one KV block.
WARM_PROMPT, WARM_TOKENS = [1, 2, 3], 8
#: The longest generation a row asks for: the hang and the die come well before it.
LONGEST = 100
#: The torch node's RSS slack: the KV blocks a row's load touches stay resident, reused by the
#: next generations (the pool allocates its storage untouched and keeps what it has used).
TORCH_RSS_SLACK = 32 * 2**20
#: How late past its bound a probe or a Finish may come: the watchdog's period, a poll, a scrape.
SLACK_S = 1.0


def reference(prompt: tuple[int, ...], n: int) -> list[int]:
    """The builtin model's first `n` (at most `LONGEST`) greedy tokens after `prompt`."""
    assert n <= LONGEST
    return _reference(prompt)[:n]


@functools.cache
def _reference(prompt: tuple[int, ...]) -> list[int]:
    """`LONGEST` tokens after `prompt`, alone on an engine in this process, once a prompt."""
    from nodeagent.daemon import GenExtras
    from proto.params import GenParams

    daemon = _engine()
    return list(daemon.generate_tokens_streaming(list(prompt), GenParams(), LONGEST, 0, GenExtras(), lambda b: True).tokens)


@functools.cache
def _engine():
    from nodeagent.engine.torch_engine import TorchDaemon

    return TorchDaemon.load("builtin", max_batch=1)


class HealthWatch:
    """Polls `/health` every 50 ms on a thread; the changes, with when they came."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.changes: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            answer = probe(self.addr, "/health")
            if answer is not None and (not self.changes or self.changes[-1][1:] != answer):
                self.changes.append((time.monotonic(), *answer))

    def first(self, status: int, by: float) -> float | None:
        """When `/health` first answered `status`, waiting for it until `by` (monotonic s)."""
        while True:
            seen = next((at for at, code, _ in self.changes if code == status), None)
            if seen is not None or time.monotonic() > by:
                return seen
            time.sleep(0.02)

    def story(self, since: float) -> str:
        return " → ".join(f"{code} {body!r} at {at - since:+.1f} s" for at, code, body in self.changes)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def probe(addr: str, path: str) -> tuple[int, str] | None:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=2) as answer:
            return answer.status, answer.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()
    except OSError:
        return None


def _node(spec: str, *args: str) -> tuple[WatchedNode, str]:
    node = WatchedNode(*BUILTIN, *args, env={"SUPERFLUID_FAILPOINTS": spec})
    addr = re.search(METRICS_AT, node.proc.wait_line(METRICS_AT)).group(1)
    with FleetHead.connect(node.addr) as head:
        head.assign(1)
        head.append(1, WARM_PROMPT)
        assert head.generate(1, WARM_TOKENS).tokens == reference(tuple(WARM_PROMPT), WARM_TOKENS)
    return node, addr


def _prompt(i: int) -> list[int]:
    return [10 + i, 20 + i, 30 + i, 40 + i]


def _generate(addr: str, i: int, max_new: int, timeout: float = 60.0) -> tuple[Generation, float]:
    """Head `i` generates `max_new` tokens after its prompt; the generation and when it ended."""
    with FleetHead.connect(addr) as head:
        head.assign(100 + i)
        head.append(100 + i, _prompt(i))
        g = head.collect(head.request(100 + i, max_new, max_wall_ms=0), timeout=timeout)
        return g, time.monotonic()


def _heads(addr: str, n: int, max_new: int, first: int = 0) -> list:
    """Heads `first`.. generating at once, each on a thread; their references are worked out
    first, so that this process's own forward takes no time from the checks that follow."""
    for i in range(first, first + n + 1):
        reference(tuple(_prompt(i)), max_new)
    return [background(lambda i=i: _generate(addr, i, max_new), timeout=90) for i in range(first, first + n)]


def _check(row: Row, g: Generation, i: int, max_new: int, reasons: set[int]) -> None:
    """Counts a generation whose tokens are not the model's (a prefix, unless it ran to LENGTH)
    as lost, and one whose finish is not among `reasons` as wrong."""
    want = reference(tuple(_prompt(i)), max_new)
    exact = g.tokens == want if g.finish == finish.LENGTH else g.tokens == want[: len(g.tokens)]
    if not exact:
        row.lost += 1
        row.note(f"head {i}: tokens differ from the model's")
    if g.finish not in reasons:
        row.wrong += 1
        row.note(f"head {i}: finish {g.finish}")


def _fired(node: WatchedNode, spec: str) -> float:
    """When the node said the failpoint fired (as this process read the line)."""
    node.proc.wait_line(re.escape(f"failpoint {spec} fires"), timeout=60)
    return time.monotonic()


def _healthy_throughout(row: Row, watch: HealthWatch) -> None:
    if any(code != 200 for _, code, _ in watch.changes):
        row.wrong += 1
        row.note(f"/health was not 200 throughout: {watch.story(watch.changes[0][0])}")


def hang(heads: int) -> Row:
    """A decode step that never returns: /health 503 and every head's Finish(ERROR) within the
    stall timeout (+ slack), a new request answered with ERROR at once; the node stays up, 503."""
    spec = "engine.step=hang@30"
    row = Row("engine hang", f"{heads} heads, {spec}", 1, slack=TORCH_RSS_SLACK)
    node, addr = _node(spec)
    try:
        with Measured(row, node):
            watch = HealthWatch(addr)
            waits = _heads(node.addr, heads, LONGEST)
            fired = _fired(node, spec)
            bound = STALL_MS / 1000 + SLACK_S
            for i, wait in enumerate(waits):
                g, ended = wait()
                _check(row, g, i, LONGEST, {finish.ERROR})
                if ended - fired > bound:
                    row.wrong += 1
                    row.note(f"head {i}: Finish {ended - fired:.1f} s after the hang")
            unhealthy = watch.first(503, by=fired + bound)
            if unhealthy is None:
                row.wrong += 1
                row.note(f"/health: {watch.story(fired)}")
            asked = time.monotonic()
            g, answered = _generate(node.addr, heads, 20, timeout=5)
            if g.finish != finish.ERROR or answered - asked > SLACK_S:
                row.wrong += 1
                row.note(f"a new request: finish {g.finish} after {answered - asked:.1f} s")
            if probe(addr, "/ready") != (503, "engine stalled"):
                row.wrong += 1
                row.note(f"/ready {probe(addr, '/ready')}")
            watch.stop()
            row.detail = (
                f"{heads} heads ERROR within {max(w()[1] for w in waits) - fired:.1f} s; /health {watch.story(fired)}; "
                f"a new request ERROR in {answered - asked:.2f} s"
            )
    finally:
        node.close()
    return row


def raise_(heads: int) -> Row:
    """A decode step that raises, two lanes for `heads` heads: the step's generations end ERROR,
    the others and the next one run to LENGTH token-exact, /health 200 throughout."""
    spec = "engine.step=raise@30"
    row = Row("engine raise", f"{heads} heads on 2 lanes, {spec}", 1, slack=TORCH_RSS_SLACK)
    node, addr = _node(spec, "--max-batch", "2")
    try:
        with Measured(row, node):
            watch = HealthWatch(addr)
            results = [wait()[0] for wait in _heads(node.addr, heads, 60)]
            for i, g in enumerate(results):
                _check(row, g, i, 60, {finish.ERROR, finish.LENGTH})
            errors = sum(g.finish == finish.ERROR for g in results)
            if not 1 <= errors <= 2:
                row.wrong += 1
                row.note(f"{errors} generations ended ERROR; the step held 1 or 2")
            g, _ = _generate(node.addr, heads, 60)
            _check(row, g, heads, 60, {finish.LENGTH})
            watch.stop()
            _healthy_throughout(row, watch)
            row.detail = f"{errors} ERROR (the step's), {heads - errors} LENGTH exact; the next exact; /health 200 throughout"
    finally:
        node.close()
    return row


def die(heads: int) -> Row:
    """The scheduler thread dies: every head gets Finish(ERROR) and the process exits 4 within the
    drain bound. /health answers 503 'engine failed' meanwhile, which the table shows when a poll
    caught it: the window lasts only until the heads have their Finish."""
    spec = "engine.scheduler=die@40"
    row = Row("engine die", f"{heads} heads, {spec}", 1, exited=True)
    node, addr = _node(spec)
    try:
        row.baseline_rss = node.rss()
        watch = HealthWatch(addr)
        began = time.monotonic()
        waits = _heads(node.addr, heads, LONGEST)
        fired = _fired(node, spec)
        for i, wait in enumerate(waits):
            _check(row, wait()[0], i, LONGEST, {finish.ERROR})
        code = node.proc.wait(DRAIN_MS / 1000 + SLACK_S)
        exited = time.monotonic()
        row.seconds = exited - began
        watch.stop()
        if code != 4 or exited - fired > DRAIN_MS / 1000 + SLACK_S:
            row.crashes += 1
            row.note(f"exit {code} {exited - fired:.1f} s after the fault")
        row.crashes += sum("Fatal Python error" in line for line in node.proc.lines)
        row.detail = f"{heads} heads ERROR; /health {watch.story(fired)}; exit {code} {exited - fired:.1f} s after"
    finally:
        node.close()
    return row


def oom(heads: int) -> Row:
    """A KV block allocation out of memory while `heads` lanes decode: lanes are preempted and
    every generation runs to LENGTH token-exact, /health 200 throughout."""
    spec = "engine.alloc=oom@12"
    row = Row("engine oom", f"{heads} heads, {spec}", 1, slack=TORCH_RSS_SLACK)
    node, addr = _node(spec, "--max-batch", str(heads))
    try:
        with Measured(row, node):
            watch = HealthWatch(addr)
            for i, wait in enumerate(_heads(node.addr, heads, 100)):
                _check(row, wait()[0], i, 100, {finish.LENGTH})
            watch.stop()
            _healthy_throughout(row, watch)
            shed = [line for line in node.proc.lines if "out of memory in a decode step" in line]
            if not shed:
                row.wrong += 1
                row.note("no lane was preempted")
            row.detail = f"{shed[0].split('torch engine: ')[-1] if shed else 'nothing preempted'}; all {heads} LENGTH exact"
    finally:
        node.close()
    return row
