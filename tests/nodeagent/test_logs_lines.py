"""Every stderr line is written whole, whatever thread writes it (issue 9, finding 3): tools
scrape the `superfluid-noded:` lines and the tracing lines, and two connections failing at once
once produced `...byte headersuperfluid-noded: the connection from ...`."""

import re
import subprocess
import sys

#: Threads that say() and log at once, with the interpreter switching threads as often as it can.
WRITERS = r"""
import logging, sys, threading
from nodeagent import logs
sys.setswitchinterval(1e-6)
logs.init_stderr("info")
log = logging.getLogger("nodeagent.noded")
def run(n):
    for i in range(300):
        logs.say(f"the connection from 127.0.0.1:{n} ended: line {i} of writer {n}")
        log.warning(f"writer {n} line {i}", extra={"fields": {"peer": n}})
threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
for t in threads: t.start()
for t in threads: t.join()
"""

SAY = re.compile(r"superfluid-noded: the connection from 127\.0\.0\.1:\d ended: line \d+ of writer \d")
TRACE = re.compile(r"\S+Z  WARN nodeagent::noded: writer \d line \d+ peer=\d")


def test_concurrent_say_and_log_lines_are_never_merged_or_split():
    err = subprocess.run(
        [sys.executable, "-c", WRITERS], capture_output=True, text=True, timeout=60, check=True
    ).stderr
    lines = err.splitlines()
    broken = [line for line in lines if not (SAY.fullmatch(line) or TRACE.fullmatch(line))]
    assert broken == []
    assert len(lines) == 2 * 8 * 300
