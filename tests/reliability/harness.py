"""What every reliability row shares: a `superfluid-noded` process watched from outside (its
resident memory, threads and stderr), and the row the table prints.

A row is clean when nothing was lost or duplicated, the node did not crash (it is still
running, or exited 0 when the row stops it, and printed no traceback), and its memory came back
to where it was before the load: within `RSS_SLACK` of the baseline, which is taken after a
warm-up generation so that first-use allocations (imports, the mock's tables) are in it.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from nodeproc import Noded

from conformance.head import FleetHead
from conformance.reference import mock_tokens

#: How far above its baseline a node's resident memory may settle after a row: the allocator
#: keeps some freed memory for reuse (its arenas, the interpreter's free lists).
RSS_SLACK = 8 * 1024 * 1024
#: How long a row waits, after its load has stopped, for the node's threads and memory to settle.
SETTLE_S = 1.5
CRASH_MARKS = ("Traceback", "Exception in thread", "Fatal Python error")


@dataclass
class Row:
    """One line of the table."""

    test: str
    load: str
    faults: int
    lost: int = 0
    duplicated: int = 0
    crashes: int = 0
    #: Answers that were wrong though nothing was lost: a probe let in, a head kept out, a
    #: frame that should have been refused, a wrong finish reason.
    wrong: int = 0
    peak_rss: int = 0
    baseline_rss: int = 0
    after_rss: int = 0
    #: A soak's RSS in the middle of its load (its floor over the second quarter): from there to
    #: its end (`after_rss`, the last quarter's floor) it may grow by `slack` at most, its start
    #: being allowed the growth of a node warming up.
    middle_rss: int = 0
    #: How far above its baseline (a soak: its middle) the node may settle after this row.
    slack: int = RSS_SLACK
    seconds: float = 0.0
    #: The row stopped the node (a drain): its memory went back with the process.
    exited: bool = False
    notes: list[str] = field(default_factory=list)
    #: What the row saw, printed after "ok" (the failures' notes replace it).
    detail: str = ""

    def back_to_baseline(self) -> bool:
        return self.exited or self.after_rss <= (self.middle_rss or self.baseline_rss) + self.slack

    def clean(self) -> bool:
        return not (self.lost or self.duplicated or self.crashes or self.wrong) and self.back_to_baseline()

    def note(self, what: str) -> None:
        """Keeps the first few reasons a row is not clean, for the table."""
        if len(self.notes) < 3:
            self.notes.append(what)


class WatchedNode:
    """A node process with its own home directory, and the figures the table needs."""

    def __init__(self, *args: str, token: bytes = b"", env: dict[str, str] | None = None) -> None:
        self._home = tempfile.TemporaryDirectory(prefix="sf-reliability-")
        self.home = Path(self._home.name)
        self.token = token
        if token:
            (self.home / "token").write_bytes(token)
            args = (*args, "--auth-file", str(self.home / "token"))
        self.proc = Noded(args, self.home, **(env or {}))
        self.addr = self.proc.addr

    def status(self, field_: str) -> int:
        """A figure of /proc/<pid>/status, in bytes for the memory ones."""
        for line in Path(f"/proc/{self.proc.proc.pid}/status").read_text().splitlines():
            if line.startswith(field_ + ":"):
                value = line.split()[1]
                return int(value) * 1024 if line.rstrip().endswith("kB") else int(value)
        raise KeyError(field_)

    def rss(self) -> int:
        return self.status("VmRSS")

    def threads(self) -> int:
        return self.status("Threads")

    def crashes(self) -> int:
        """Tracebacks it printed, and one more if it died on its own."""
        marks = sum(any(m in line for m in CRASH_MARKS) for line in self.proc.lines)
        return marks + (self.proc.proc.poll() not in (None, 0))

    def close(self) -> None:
        self.proc.kill()
        self._home.cleanup()


def warm_up(node: WatchedNode) -> None:
    """One generation, so the node's first-use allocations happen before the baseline."""
    with FleetHead.connect(node.addr, auth=node.token) as head:
        head.assign(1)
        head.append(1, [1, 2, 3])
        assert head.generate(1, 8).tokens == mock_tokens([1, 2, 3], 8)


def settle(node: WatchedNode, threads: int, timeout: float = 10.0) -> None:
    """Waits for the node to be back to `threads` threads (its connections ended), then
    `SETTLE_S` more for its memory."""
    deadline = time.monotonic() + timeout
    while node.threads() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(SETTLE_S)


class Measured:
    """`with Measured(row, node):` the row's baseline, peak and final memory, time and crashes."""

    def __init__(self, row: Row, node: WatchedNode) -> None:
        self.row, self.node = row, node

    def __enter__(self) -> Measured:
        self.threads = self.node.threads()
        self.row.baseline_rss = self.node.rss()
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.row.seconds = time.monotonic() - self.start
        if self.node.proc.proc.poll() is None:
            settle(self.node, self.threads)
            self.row.after_rss = self.node.rss()
            self.row.peak_rss = self.node.status("VmHWM")
        else:
            self.row.exited = True
        self.row.crashes += self.node.crashes()


def table(rows: list[Row]) -> str:
    """The table `make reliability` prints."""
    head = ("test", "load", "faults", "lost", "dup", "crashes", "wrong", "peak RSS", "RSS before→after", "time", "")
    lines = [head]
    for r in rows:
        lines.append((
            r.test,
            r.load,
            str(r.faults),
            str(r.lost),
            str(r.duplicated),
            str(r.crashes),
            str(r.wrong),
            _mb(r.peak_rss),
            _rss_column(r),
            f"{r.seconds:.1f} s",
            ("ok" + (f": {r.detail}" if r.detail else "")) if r.clean() else "FAIL " + "; ".join(r.notes),
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths).rstrip())
    return "\n".join(text)


def _rss_column(r: Row) -> str:
    middle = f"{_mb(r.middle_rss)}→" if r.middle_rss else ""
    return f"{_mb(r.baseline_rss)}→{middle}" + ("exit 0" if r.exited else _mb(r.after_rss))


def _mb(n: int) -> str:
    return f"{n / 2**20:.0f} MB"
