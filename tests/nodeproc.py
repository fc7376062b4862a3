"""`superfluid-noded` as a real process for tests: started with arguments and its own
`SUPERFLUID_HOME`, its stderr read line by line on a thread, killed after the test."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

SERVING = re.compile(r"^superfluid-noded: node '(.*)' serving '(.*)' on (\S+) \(Link F/TCP\)$")
START_TIMEOUT = 20.0


class Noded:
    """One `superfluid-noded` process; its stderr is read on a thread, line by line. It waits
    for `ready` (the serving line by default; None: nothing) before it returns. `env` adds to
    this process's environment; a variable given as None is left out."""

    def __init__(self, args, home, ready: re.Pattern | None = SERVING, **env: str | None):
        base = {k: v for k, v in os.environ.items() if k not in ("SUPERFLUID_LOG", "RUST_LOG")}
        # The compiled-kernel cache is shared: it is keyed by its sources, and a cold one costs
        # seconds of every node's load.
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        base.update(HOME=str(home), SUPERFLUID_HOME=str(home / ".superfluid"), XDG_CACHE_HOME=cache)
        base.update(env)
        base = {k: v for k, v in base.items() if v is not None}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", *args],
            env=base,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._new: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.identity = self.model_name = self.addr = None
        if ready is SERVING:
            match = SERVING.match(self.wait_line(SERVING.pattern, START_TIMEOUT))
            self.identity, self.model_name, self.addr = match.groups()
        elif ready is not None:
            self.wait_line(ready.pattern, START_TIMEOUT)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            self._new.put(line.rstrip("\n"))
        self._new.put(None)

    def wait_line(self, pattern: str, timeout: float = 10.0) -> str:
        """The first stderr line, old or new, that `pattern` matches."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            # Count before scanning: a line appended during the scan is scanned next time.
            upto = len(self.lines)
            for line in self.lines[seen:upto]:
                if re.search(pattern, line):
                    return line
            seen = upto
            try:
                if self._new.get(timeout=max(deadline - time.monotonic(), 0.01)) is None and seen == len(self.lines):
                    raise AssertionError(f"noded exited without {pattern!r}:\n" + "\n".join(self.lines))
            except queue.Empty:
                raise AssertionError(f"no {pattern!r} within {timeout} s:\n" + "\n".join(self.lines)) from None

    def stop(self, sig=signal.SIGTERM, timeout: float = 10.0) -> int:
        self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 10.0) -> int:
        """The exit code, once every stderr line is in `lines`."""
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

