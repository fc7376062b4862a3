"""Logging to stderr in the shape of the Rust node's `tracing_subscriber` fmt output.

Operators run Rust and Python nodes side by side and read their logs with the same eyes and
tools, so a line reads `2026-01-02T03:04:05.678901Z  WARN nodeagent::agent: message k=v`, and
the level comes from the same kind of filter: `SUPERFLUID_LOG`, else `RUST_LOG`, else `info`;
a filter is `level` or `target=level` directives separated by commas (`warn,nodeagent=debug`).
Key-value fields ride on a record as `extra={"fields": {...}}`.

The `superfluid-noded: ...` lines that tools scrape (the serving line, refusals, the drain) go
through the same logging as a record of their own level, `CONSOLE`, on the logger named after
the program: in the text format they keep the Rust wording exactly, every filter but `off`
lets them through (Rust prints them whatever `RUST_LOG` says), and `--log-format json` turns
them into JSON like every other record.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

#: The node's name at the head of its console lines, as the Rust binary's.
PROGRAM = "superfluid-noded"
TRACE = 5
logging.addLevelName(TRACE, "TRACE")
#: The level of a `program: message` line: above every level a filter names, below `off`.
CONSOLE = logging.CRITICAL + 5
logging.addLevelName(CONSOLE, "CONSOLE")

LEVELS = {
    "trace": TRACE,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}

#: Every stderr line, from any thread, goes out under this one lock in one write: tools scrape
#: the lines, and two threads must never merge theirs.
_LINE_LOCK = threading.Lock()

_NAMES = {TRACE: "TRACE", logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARN", CONSOLE: "INFO"}


def _level(record: logging.LogRecord) -> str:
    return _NAMES.get(record.levelno, "ERROR" if record.levelno >= logging.ERROR else "INFO")


def _stamp(record: logging.LogRecord) -> str:
    """RFC 3339 UTC with microseconds, as tracing prints it."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.created % 1 * 1_000_000):06d}Z"


class TracingFormatter(logging.Formatter):
    """`<RFC 3339 UTC, microseconds>  LEVEL target: message k=v` (the level right-aligned in 5)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == CONSOLE:
            return f"{record.name}: {record.getMessage()}"
        target = record.name.replace(".", "::")
        line = f"{_stamp(record)} {_level(record):>5} {target}: {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if fields:
            line += "".join(f" {k}={v}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object a line, for log shippers: `timestamp`, `level`, `target` (the tracing
    target; `superfluid-noded` for the console lines), `message`, then the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "timestamp": _stamp(record),
            "level": _level(record),
            "target": record.name.replace(".", "::"),
            "message": record.getMessage(),
        }
        for key, value in (getattr(record, "fields", None) or {}).items():
            entry.setdefault(key, _json_value(value))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


FORMATTERS = {"text": TracingFormatter, "json": JsonFormatter}


def fields(**values) -> dict:
    """A record's key=value fields, to pass as `extra=`: printed after the message (text) or
    as keys of the object (JSON)."""
    return {"fields": values}


def say(message: str) -> None:
    """One whole `superfluid-noded:` line on stderr, flushed at once: tools scrape these."""
    console(PROGRAM, message)


def console(program: str, message: str) -> None:
    """A `program: message` line (the lines tools scrape), through logging at `CONSOLE`."""
    logging.getLogger(program).log(CONSOLE, message)


def write_line(line: str, stream=None) -> None:
    """`line` and its newline in one write, flushed, never interleaved with another line."""
    stream = sys.stderr if stream is None else stream
    with _LINE_LOCK:
        stream.write(line + "\n")
        stream.flush()


class LineHandler(logging.StreamHandler):
    """A stream handler whose records go out through `write_line`, whole."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_line(self.format(record), self.stream)
        except Exception:  # noqa: BLE001 - logging's own policy for a record that cannot be written
            self.handleError(record)


def parse_filter(spec: str) -> tuple[int, dict[str, int]]:
    """The default level and per-target levels of an env-filter string; ValueError if malformed."""
    default = logging.INFO
    targets: dict[str, int] = {}
    for directive in filter(None, (d.strip() for d in spec.split(","))):
        target, _, level = directive.rpartition("=")
        if level.lower() not in LEVELS:
            raise ValueError(f"unknown level {level!r} in {directive!r}")
        if target:
            targets[target.replace("::", ".")] = LEVELS[level.lower()]
        else:
            default = LEVELS[level.lower()]
    return default, targets


def filter_from_env(env=os.environ) -> str:
    return env.get("SUPERFLUID_LOG") or env.get("RUST_LOG") or "info"


def init_stderr(spec: str, program: str = "superfluid-noded", fmt: str = "text") -> None:
    """Sends every log record to stderr, as the Rust node does (`fmt` "text") or as JSON lines
    ("json"); a bad filter falls back to info."""
    try:
        default, targets = parse_filter(spec)
    except ValueError as e:
        print(f"{program}: logging: log filter {spec!r}: {e} (using \"info\")", file=sys.stderr)
        default, targets = logging.INFO, {}
    handler = LineHandler(sys.stderr)
    handler.setFormatter(FORMATTERS[fmt]())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(default)
    for target, level in targets.items():
        logging.getLogger(target).setLevel(level)


def _json_value(value: object) -> int | float | bool | str | None:
    """A field as JSON carries it: numbers, booleans and null as they are, the rest as text."""
    return value if value is None or isinstance(value, (int, float, bool)) else str(value)
