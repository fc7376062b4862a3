"""`superfluid-noded`'s entry point: parses the command line and runs listen or join mode.

It sits above `cli` (flags, usage, what the command line turns into), `noded` (the node and its
accept loop) and `join` (dialling the head): the node's objects take a plain `NodeConfig`, and
only this module wires them to the command line.
"""

from __future__ import annotations

import sys

from linkf.driver import show_address
from nodeagent import logs
from nodeagent.cli import (
    USAGE,
    Exit,
    Options,
    ShowVersion,
    UsageError,
    bind,
    fleet_token,
    identity,
    join_token,
    load,
    node_config,
    observers,
    parse_args,
    pick_runtime,
    start_metrics,
    version,
)
from nodeagent.join import Joiner
from nodeagent.logs import PROGRAM, say
from nodeagent.noded import LISTEN_BACKLOG, Node


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


def run_listen(opts: Options) -> int:
    """Listen mode. Everything that can refuse the node does so before the model loads."""
    token = fleet_token(opts)
    listener = bind(opts.listen)
    try:
        node = _loaded_node(opts, token)
        listener.listen(LISTEN_BACKLOG)
        node.catch_signals()
        node.started()  # before the line that says so: /ready agrees with it
        say(
            f"node '{node.identity}' serving '{node.model_name}' on "
            f"{show_address(listener.getsockname())} (Link F/TCP)"
        )
        if token:
            say("the link is encrypted and both ends are checked against the token")
        return node.serve_until_signalled(listener)
    finally:
        listener.close()


def run_join(opts: Options) -> int:
    """Join mode: the node dials the head. Everything that can refuse the node does so before
    the model loads."""
    head = opts.join
    if head is None:
        raise Exit(2, "join needs the head's address")
    token = join_token(opts, head)
    node = _loaded_node(opts, token)
    node.catch_signals()
    joiner = Joiner(node, head, token, node.observer)
    node.started()
    return joiner.run(opts.max_batch)


def _loaded_node(opts: Options, token: bytes) -> Node:
    """The metrics port bound, the model loaded and said, and the node that serves it."""
    metrics = start_metrics(opts)
    daemon = load(opts, pick_runtime(opts))
    say(daemon.summary())
    return Node(daemon, node_config(opts), token, identity(opts), observers(daemon, opts, metrics))
