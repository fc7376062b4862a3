"""`superfluid-conformance`: checks a running node over the wire.

    superfluid-conformance HOST:PORT [--auth-file F] [--mock] [--only NAME[,NAME]] [--junit FILE]
    superfluid-conformance replay FILE --target HOST:PORT [--auth-file F]
    superfluid-conformance show FILE

The first runs the scenario suite and prints a table; the exit code is 0 only if nothing failed.
`replay` plays the head's side of a transcript (`superfluid-noded --record DIR`) to another node
and lists every way its answers differ (exit 1 when they do); `show` prints a transcript.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conformance import replay
from conformance.scenario import Target
from conformance.suite import UnknownScenario, junit, passed, run_suite, select, table
from linkf import transcript
from linkf.secure import read_token

PROGRAM = "superfluid-conformance"


class OptionError(ValueError):
    """An option the command cannot use; the message says which and why."""


def auth_from(auth_file: str | None) -> bytes:
    """The fleet token in `--auth-file`, or none."""
    if auth_file is None:
        return b""
    try:
        return read_token(auth_file)
    except OSError as e:
        raise OptionError(f"cannot read --auth-file {auth_file}: {e.strerror or e}") from None


def suite_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROGRAM, description="Run the Link F conformance suite against a node.")
    p.add_argument("target", metavar="HOST:PORT", help="the node (superfluid-noded --listen)")
    p.add_argument("--auth-file", help="the fleet token: the link is Noise-encrypted and HELLO carries it")
    p.add_argument("--mock", action="store_true", help="the node serves --engine mock: check tokens exactly")
    p.add_argument("--only", action="append", help="run only these scenarios (comma-separated, repeatable)")
    p.add_argument("--junit", metavar="FILE", help="also write the outcomes as JUnit XML")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds any single wait lasts (default 10)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    return p


def replay_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{PROGRAM} replay", description="Replay a transcript's head side to a node.")
    p.add_argument("file", type=Path, help="a transcript written by superfluid-noded --record")
    p.add_argument("--target", metavar="HOST:PORT", required=True)
    p.add_argument("--auth-file")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each expected answer")
    return p


def show_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{PROGRAM} show", description="Print a transcript, one frame a line.")
    p.add_argument("file", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["replay"]:
            return run_replay(replay_parser().parse_args(argv[1:]))
        if argv[:1] == ["show"]:
            return run_show(show_parser().parse_args(argv[1:]))
        return run_checks(suite_parser().parse_args(argv))
    except (OptionError, UnknownScenario, transcript.TranscriptError, OSError) as e:
        print(f"{PROGRAM}: {e}", file=sys.stderr)
        return 2


def run_checks(args: argparse.Namespace) -> int:
    if args.list:
        for s in select(None):
            print(f"{s.name:<32} {'(--mock) ' if s.mock else ''}{s.doc}")
        return 0
    only = [name for names in args.only or () for name in names.split(",") if name]
    target = Target(args.target, auth_from(args.auth_file), args.mock, args.timeout)
    outcomes = run_suite(target, only)
    print(table(outcomes))
    if args.junit:
        Path(args.junit).write_bytes(junit(outcomes, target))
    return 0 if passed(outcomes) else 1


def run_replay(args: argparse.Namespace) -> int:
    differences = replay.replay(transcript.read(args.file), args.target, auth_from(args.auth_file), args.timeout)
    for d in differences:
        print(d)
    print(f"{len(differences)} difference(s) replaying {args.file} against {args.target}")
    return 1 if differences else 0


def run_show(args: argparse.Namespace) -> int:
    for line in transcript.show(transcript.read(args.file)):
        print(line)
    return 0
