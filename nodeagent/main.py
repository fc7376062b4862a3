"""`superfluid-noded`'s entry point: parses the command line and runs listen or join mode.

It sits above `cli` (flags, usage, the helpers both modes share), `noded` (listen mode) and
`join` (join mode), so none of those imports another that imports it back.
"""

from __future__ import annotations

import sys

from nodeagent import logs
from nodeagent.cli import PROGRAM, USAGE, Exit, ShowVersion, UsageError, parse_args, say, version
from nodeagent.join import run_join
from nodeagent.noded import run_listen


def main(argv: list[str] | None = None) -> int:
    logs.init_stderr(logs.filter_from_env(), PROGRAM)
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts = parse_args(argv)
        if opts.log_format != "text":
            logs.init_stderr(logs.filter_from_env(), PROGRAM, opts.log_format)
        return run_join(opts) if opts.join is not None else run_listen(opts)
    except ShowVersion:
        print(f"{PROGRAM} {version()}", flush=True)
        return 0
    except UsageError as e:
        if e.message:
            say(e.message)
        logs.write_line(USAGE)
        return 2
    except Exit as e:
        if e.message:
            say(e.message)
        return e.code
    except KeyboardInterrupt:  # before the node catches signals: while the model loads
        return 130
