"""`superfluid-noded`: the node agent as its own process (node-behaviour.md §3).

Flags, defaults, exit codes and stderr lines follow the Rust binary, since tools and heads
scrape them: 2 for a usage error or an open listener without a token, 1 for an unreadable token
file or a port that will not bind, 3 for a model that will not load. Unlike the Rust binary it
drains on SIGTERM/SIGINT: it stops accepting, lets running generations finish, and exits 0.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from nodeagent import logs
from nodeagent.engine import RUNTIMES

PROGRAM = "superfluid-noded"
DEFAULT_LISTEN = "0.0.0.0:8454"
DEFAULT_LANES = 8
DEFAULT_MOCK_CONTEXT = 4096
MIN_CONTEXT = 512
DEVICES = ("auto", "cpu", "cuda")
#: ASCII whitespace as Rust's `trim_ascii` sees it (no vertical tab).
ASCII_WHITESPACE = b" \t\n\r\x0c"

USAGE = f"""\
usage: {PROGRAM} --model <path|builtin> [--listen <ip:port>] [--auth-file <path>] \
[--runtime <id>] [--model-name <id>] [--max-context N] [--max-batch N] [--identity <name>] \
[--offline] [--insecure-no-auth] [--idle-timeout-ms N] [--handshake-timeout-ms N] \
[--device auto|cpu|cuda] [--kv-budget-mb N] [--drain-timeout-ms N] [--token-delay-ms N]

The model is a Hugging Face checkpoint directory (config.json and *.safetensors) or `builtin`,
the small embedded model, served by the torch runtime; `--runtime mock` (alias --engine) needs
no model. Nothing is downloaded.
(--listen defaults to {DEFAULT_LISTEN}, the fleet-worker port next to BASE 8453;
 --auth-file holds the fleet token (default $SUPERFLUID_HOME/fleet/token, from
 `superfluid fleet token`); with it the link is encrypted and both ends checked.
 --max-context defaults to 4096 for the mock and to what the device holds for torch, at least
 512; --max-batch (default 8) is the lanes; --drain-timeout-ms (default 30000) bounds how long
 SIGTERM waits for running generations; --token-delay-ms slows the mock, for tests.
 There is no sampling flag here: a fleet generation must match the local path token for
 token, so the node applies only what the request carries.)"""

log = logging.getLogger("nodeagent.cli")


class Exit(Exception):
    """Ends `main` with `code`, after printing `message` (if any) as a `superfluid-noded:` line."""

    def __init__(self, code: int, message: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message


class UsageError(Exit):
    def __init__(self):
        super().__init__(2)


def say(message: str) -> None:
    """One whole `superfluid-noded:` line on stderr, flushed at once: tools scrape these."""
    logs.write_line(f"{PROGRAM}: {message}")


@dataclass
class Options:
    listen: str = DEFAULT_LISTEN
    model: str | None = None
    runtime: str | None = None
    max_context: int | None = None
    max_batch: int = DEFAULT_LANES
    identity: str | None = None
    model_name: str | None = None
    auth_file: str | None = None
    insecure_no_auth: bool = False
    offline: bool = False
    handshake_timeout_ms: int = 10_000
    idle_timeout_ms: int = 30_000
    device: str = "auto"
    kv_budget_mb: int | None = None
    drain_timeout_ms: int = 30_000
    token_delay_ms: int = 0


def _count(v: str) -> int:
    """An unsigned integer, as Rust parses a `u32`/`u64` flag."""
    if not re.fullmatch(r"\+?[0-9]+", v):
        raise ValueError(v)
    return int(v)


def _signed(v: str) -> int:
    """A signed integer, as Rust parses `--max-context` (an `i32`)."""
    if not re.fullmatch(r"[+-]?[0-9]+", v) or not -(2**31) <= int(v) < 2**31:
        raise ValueError(v)
    return int(v)


def _device(v: str) -> str:
    if v not in DEVICES:
        raise ValueError(v)
    return v


#: flag -> (field, parser); a parser of None marks a switch.
FLAGS = {
    "--listen": ("listen", str),
    "--model": ("model", str),
    "--runtime": ("runtime", str),
    "--engine": ("runtime", str),
    "--max-context": ("max_context", _signed),
    "--max-batch": ("max_batch", _count),
    "--identity": ("identity", str),
    "--model-name": ("model_name", str),
    "--auth-file": ("auth_file", str),
    "--insecure-no-auth": ("insecure_no_auth", None),
    "--offline": ("offline", None),
    "--handshake-timeout-ms": ("handshake_timeout_ms", _count),
    "--idle-timeout-ms": ("idle_timeout_ms", _count),
    "--device": ("device", _device),
    "--kv-budget-mb": ("kv_budget_mb", _count),
    "--drain-timeout-ms": ("drain_timeout_ms", _count),
    "--token-delay-ms": ("token_delay_ms", _count),
}


def parse_args(argv: list[str]) -> Options:
    """The options `argv` gives; UsageError for an unknown flag, a missing or malformed value."""
    opts = Options()
    it = iter(argv)
    for arg in it:
        if arg not in FLAGS:
            raise UsageError()
        field, parse = FLAGS[arg]
        if parse is None:
            setattr(opts, field, True)
            continue
        value = next(it, None)
        if value is None:
            raise UsageError()
        try:
            setattr(opts, field, parse(value))
        except ValueError:
            raise UsageError() from None
    opts.max_batch = max(opts.max_batch, 1)
    if opts.model is None and opts.runtime != "mock":
        raise UsageError()
    return opts


def loopback(listen: str) -> bool:
    return listen.startswith(("127.", "localhost:", "[::1]:"))


def superfluid_home(env=os.environ) -> Path:
    home = env.get("SUPERFLUID_HOME")
    return Path(home) if home else Path.home() / ".superfluid"


def token_path(home: Path) -> Path:
    return home / "fleet" / "token"


def read_default_token(home: Path) -> bytes | None:
    """The token at `$SUPERFLUID_HOME/fleet/token`, if one has been made and is not empty."""
    try:
        token = token_path(home).read_bytes().strip(ASCII_WHITESPACE)
    except OSError:
        return None
    return token or None


def fleet_token(opts: Options) -> bytes:
    """The fleet token, or b"" where serving without one is allowed; Exit where it is not."""
    if opts.auth_file is not None:
        try:
            token = Path(opts.auth_file).read_bytes().strip(ASCII_WHITESPACE)
        except OSError as e:
            raise Exit(1, f"cannot read --auth-file {opts.auth_file}: {_os_error(e)}") from None
    else:
        home = superfluid_home()
        token = read_default_token(home) or b""
        if token:
            say(f"fleet token from {token_path(home)}")
    if token or loopback(opts.listen):
        return token
    if not opts.insecure_no_auth:
        raise Exit(
            2,
            f"refusing to serve {opts.listen} without a fleet token. Run `superfluid fleet token` "
            "on the head and pass it in --auth-file <path>, bind to loopback, or (behind an "
            "already-authenticated transport like Tailscale/WireGuard) pass --insecure-no-auth "
            "to accept transport-only trust.",
        )
    say(
        f"WARNING --insecure-no-auth: accepting any peer that reaches {opts.listen} "
        "(transport-only trust)"
    )
    return b""


def _os_error(e: OSError) -> str:
    """An OS error as Rust's `io::Error` prints it: `No such file or directory (os error 2)`."""
    if e.errno is not None and e.strerror:
        return f"{e.strerror} (os error {e.errno})"
    return str(e)


def bind(listen: str) -> socket.socket:
    """A socket bound (not yet listening) to `listen`: connects are refused until `listen()`."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise Exit(1, f"bind {listen} failed: invalid socket address")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, OverflowError) as e:
        raise Exit(1, f"bind {listen} failed: {_os_error(e) if isinstance(e, OSError) else e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise Exit(1, f"bind {listen} failed: {_os_error(e)}") from None
    return sock


def show_addr(addr: tuple) -> str:
    """A socket address as Rust prints a `SocketAddr`: `1.2.3.4:5`, `[::1]:5`."""
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def pick_runtime(opts: Options) -> str:
    """The runtime asked for, else the one the model's format needs; Exit(3) when none fits."""
    if opts.runtime is not None:
        if opts.runtime not in RUNTIMES:
            raise Exit(3, f"--runtime '{opts.runtime}' is not a runtime id (one of {', '.join(RUNTIMES)})")
        return opts.runtime
    model = opts.model or ""
    if model == "builtin" or (Path(model) / "config.json").is_file():
        return "torch"
    if not Path(model).exists():
        raise Exit(3, f"{model}: no such file or directory (this node pulls nothing)")
    raise Exit(3, f"{model}: not a checkpoint directory with a config.json; pass --runtime")


def load(opts: Options, runtime: str):
    """The daemon to serve from; Exit(3) with the reason when it will not load."""
    from nodeagent.engine import open_engine

    if runtime == "mock":
        max_context = max(opts.max_context or DEFAULT_MOCK_CONTEXT, MIN_CONTEXT)
    else:
        max_context = None if opts.max_context is None else max(opts.max_context, MIN_CONTEXT)
    try:
        return open_engine(
            runtime,
            opts.model,
            device=opts.device,
            max_batch=opts.max_batch,
            max_context=max_context,
            kv_budget_mb=opts.kv_budget_mb,
            token_delay_s=opts.token_delay_ms / 1000,
        )
    except Exception as e:  # noqa: BLE001 - whatever stops the load, the node cannot serve
        log.debug("model load failed", exc_info=True)
        raise Exit(3, f"model load failed: {e}") from None


def main(argv: list[str] | None = None) -> int:
    logs.init_stderr(logs.filter_from_env(), PROGRAM)
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(parse_args(argv))
    except UsageError:
        print(USAGE, file=sys.stderr, flush=True)
        return 2
    except Exit as e:
        if e.message:
            say(e.message)
        return e.code
    except KeyboardInterrupt:  # before the node catches signals: while the model loads
        return 130


def run(opts: Options) -> int:
    """Everything that can refuse the node does so before the model loads."""
    token = fleet_token(opts)
    listener = bind(opts.listen)
    try:
        daemon = load(opts, pick_runtime(opts))
        say(daemon.summary())
        listener.listen(128)
        from nodeagent.noded import Node  # here: it imports this module, and the wire stack

        node = Node(daemon, opts, token, identity(opts))
        node.catch_signals()
        say(
            f"node '{node.identity}' serving '{node.model_name}' on "
            f"{show_addr(listener.getsockname())} (Link F/TCP)"
        )
        if token:
            say("the link is encrypted and both ends are checked against the token")
        return node.serve_until_signalled(listener)
    finally:
        listener.close()


def identity(opts: Options) -> str:
    return opts.identity or os.environ.get("SUPERFLUID_NODE_NAME") or socket.gethostname()
