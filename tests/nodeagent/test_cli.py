"""`superfluid-noded` start-up: flags, exit codes and the stderr lines tools scrape.

Each case runs the real process; none needs a head. Serving is in tests/e2e/test_noded_process.py.
"""

import logging
import os
import re
import socket
import subprocess
import sys

import pytest

from nodeagent import cli, logs

REFUSAL = (
    "superfluid-noded: refusing to serve {listen} without a fleet token. Run `superfluid fleet "
    "token` on the head and pass it in --auth-file <path>, bind to loopback, or (behind an "
    "already-authenticated transport like Tailscale/WireGuard) pass --insecure-no-auth to accept "
    "transport-only trust."
)


@pytest.fixture
def home(tmp_path):
    return tmp_path


def noded(home, *args, timeout=30, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("SUPERFLUID_LOG", "RUST_LOG", "SUPERFLUID_NODE_NAME")}
    base.update(HOME=str(home), SUPERFLUID_HOME=str(home / ".superfluid"), **env)
    return subprocess.run(
        [sys.executable, "-m", "nodeagent", *args],
        env=base,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_token(home, content):
    path = home / ".superfluid" / "fleet" / "token"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    return path


USAGE_START = "usage: superfluid-noded --model <path|builtin>"

#: (argv, the one line that says what is wrong): each exits 2 with that line, then the usage.
BAD_INVOCATIONS = [
    ([], "--model <path|builtin> is required (only --runtime mock needs none)"),
    (["--listen", "127.0.0.1:0"], "--model <path|builtin> is required (only --runtime mock needs none)"),
    (["--engine", "torch"], "--model <path|builtin> is required (only --runtime mock needs none)"),
    (["--bogus"], "unknown flag '--bogus'"),
    (["--engine", "mock", "stray"], "unexpected argument 'stray'"),
    (["--engine", "mock", "--listen"], "--listen takes a value"),
    (["--engine", "mock", "--identity"], "--identity takes a value <name>"),
    (["--engine", "mock", "--max-batch", "abc"], "--max-batch takes a whole number, 0 or more, got 'abc'"),
    (["--engine", "mock", "--max-batch", "-1"], "--max-batch takes a whole number, 0 or more, got '-1'"),
    (["--engine", "mock", "--max-context", "1.5"], "--max-context takes a whole number, got '1.5'"),
    (["--engine", "mock", "--handshake-timeout-ms", "-5"], "--handshake-timeout-ms takes a whole number, 0 or more, got '-5'"),
    (["--engine", "mock", "--idle-timeout-ms", "10s"], "--idle-timeout-ms takes a whole number, 0 or more, got '10s'"),
    (["--engine", "mock", "--device", "tpu"], "--device takes auto or cpu or cuda or cuda:N, got 'tpu'"),
    (["--engine", "mock", "--device", "cuda:x"], "--device takes auto or cpu or cuda or cuda:N, got 'cuda:x'"),
    (["--runtime", "vllm", "--model", "m"], "--runtime takes a runtime id: mock or torch, got 'vllm'"),
    (["--engine", "mock", "--listen", "8454"], "--listen takes an address <ip:port>, such as 127.0.0.1:8454, got '8454'"),
    (
        ["--engine", "mock", "--listen", "127.0.0.1:70000"],
        "--listen takes <ip:port> with a port from 0 to 65535 (0: any free port), got '127.0.0.1:70000'",
    ),
    (["--engine", "mock", "--listen", "localhost:http"], "--listen takes an address <ip:port>, such as 127.0.0.1:8454, got 'localhost:http'"),
    (["--engine", "mock", "--metrics-listen", ":9"], "--metrics-listen takes an address <ip:port>, such as 127.0.0.1:8454, got ':9'"),
    (["--engine", "mock", "--log-format", "xml"], "--log-format takes text or json, got 'xml'"),
    (["--engine", "mock", "--token", "t"], "--token is for join mode; a listening node reads --auth-file <path>"),
    (["join"], "join takes the head's address first: join <head-host:port> --model ..."),
    (["join", "--engine", "mock"], "join takes the head's address first: join <head-host:port> --model ..."),
    (["join", "head", "--engine", "mock"], "join takes an address <ip:port>, such as 127.0.0.1:8454, got 'head'"),
    (["join", "127.0.0.1:1", "--engine", "mock", "--listen", "127.0.0.1:0"], "--listen is for listen mode; join dials the head instead"),
]


@pytest.mark.parametrize("args, reason", BAD_INVOCATIONS, ids=[" ".join(a) or "(none)" for a, _ in BAD_INVOCATIONS])
def test_a_bad_invocation_says_what_is_wrong_in_one_line_then_the_usage_and_exits_2(home, args, reason):
    out = noded(home, *args)
    assert out.returncode == 2, out.stderr
    first, *rest = out.stderr.splitlines()
    assert first == f"superfluid-noded: {reason}"
    assert rest[0].startswith(USAGE_START), out.stderr
    assert "--insecure-no-auth" in out.stderr and out.stdout == ""


def test_the_usage_names_the_environment_and_the_exit_codes():
    for name in ("SUPERFLUID_HOME", "SUPERFLUID_NODE_NAME", "SUPERFLUID_LOG", "RUST_LOG", "Exit codes"):
        assert name in cli.USAGE


def test_version_prints_the_package_version_and_exits_0(home):
    out = noded(home, "--version")
    assert out.returncode == 0 and out.stderr == ""
    assert re.fullmatch(r"superfluid-noded \d+\.\d+\.\d+\S*\n", out.stdout), out.stdout


def test_the_write_timeout_is_a_flag_with_a_ten_second_default():
    assert cli.parse_args(["--model", "builtin"]).write_timeout_ms == 10_000
    assert cli.parse_args(["--model", "builtin", "--write-timeout-ms", "0"]).write_timeout_ms == 0


def test_the_stream_interval_is_a_flag_with_a_forty_millisecond_default():
    assert cli.parse_args(["--model", "builtin"]).stream_interval_ms == 40
    assert cli.parse_args(["--model", "builtin", "--stream-interval-ms", "0"]).stream_interval_ms == 0
    assert cli.parse_args(["--model", "builtin", "--stream-interval-ms", "1000"]).stream_interval_ms == 1000
    for bad in ("-5", "1001", "40ms"):
        with pytest.raises(cli.UsageError, match=rf"--stream-interval-ms takes milliseconds from 0 to 1000, got '{bad}'"):
            cli.parse_args(["--model", "builtin", "--stream-interval-ms", bad])


def test_fast_prefill_is_an_opt_in_flag():
    assert cli.parse_args(["--model", "builtin"]).fast_prefill is False
    assert cli.parse_args(["--model", "builtin", "--fast-prefill"]).fast_prefill is True


def test_the_kv_dtype_is_a_flag_with_an_auto_default():
    assert cli.parse_args(["--model", "builtin"]).kv_dtype == "auto"
    assert cli.parse_args(["--model", "builtin", "--kv-dtype", "float32"]).kv_dtype == "float32"
    with pytest.raises(cli.UsageError, match=r"--kv-dtype takes auto or float32 or bfloat16 or float16, got 'fp8'"):
        cli.parse_args(["--model", "builtin", "--kv-dtype", "fp8"])


def test_cuda_n_is_a_device_the_command_line_takes():
    assert cli.parse_args(["--model", "builtin", "--device", "cuda:1"]).device == "cuda:1"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_a_usage_error_as_in_the_rust_binary(home, flag):
    """The Rust binary knows no --help: any flag it does not know prints the usage and exits 2.
    Scripts written against it see the same here."""
    out = noded(home, flag)
    assert out.returncode == 2 and out.stderr.startswith(USAGE_START) and out.stdout == ""


def test_an_open_listener_without_a_token_is_refused_before_anything_loads(home):
    out = noded(home, "--listen", "0.0.0.0:0", "--model", "nobody-here/no-such-model")
    assert out.returncode == 2, out.stderr
    assert out.stderr == REFUSAL.format(listen="0.0.0.0:0") + "\n"
    assert not (home / ".superfluid").exists()


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:0", "[::1]:0", "127.8.9.10:0"])
def test_loopback_needs_no_token(listen):
    assert cli.loopback(listen)


@pytest.mark.parametrize("listen", ["0.0.0.0:8454", "[::]:0", "10.0.0.1:1", "localhost.example:1", "128.0.0.1:1"])
def test_other_addresses_are_off_loopback(listen):
    assert not cli.loopback(listen)


def test_an_empty_token_file_counts_as_no_token(home):
    write_token(home, b" \n\t ")
    out = noded(home, "--listen", "0.0.0.0:0", "--engine", "mock")
    assert out.returncode == 2 and REFUSAL.format(listen="0.0.0.0:0") in out.stderr


def test_an_empty_auth_file_is_named_as_empty(home):
    empty = home / "token"
    empty.write_bytes(b"\n")
    out = noded(home, "--listen", "0.0.0.0:0", "--engine", "mock", "--auth-file", str(empty))
    assert out.returncode == 2
    assert out.stderr.startswith(
        f"superfluid-noded: refusing to serve 0.0.0.0:0: --auth-file {empty} holds no token (it is empty"
    ), out.stderr


def test_the_default_token_file_is_used_and_named(home):
    path = write_token(home, b"  t0ken\n")
    out = noded(home, "--listen", "0.0.0.0:0", "--model", str(home / "absent"))
    assert out.returncode == 3, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == f"superfluid-noded: fleet token from {path}"
    assert str(home / "absent") in lines[-1]


def test_insecure_no_auth_warns_and_goes_on(home):
    out = noded(home, "--listen", "0.0.0.0:0", "--insecure-no-auth", "--model", str(home / "absent"))
    assert out.returncode == 3, out.stderr
    assert out.stderr.splitlines()[0] == (
        "superfluid-noded: WARNING --insecure-no-auth: accepting any peer that reaches 0.0.0.0:0 "
        "(transport-only trust)"
    )


def test_an_unreadable_auth_file_exits_1_even_off_loopback(home):
    missing = home / "nope"
    out = noded(home, "--listen", "0.0.0.0:0", "--engine", "mock", "--auth-file", str(missing))
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == (
        f"superfluid-noded: cannot read --auth-file {missing}: No such file or directory (os error 2)"
    )
    out = noded(home, "--listen", "0.0.0.0:0", "--engine", "mock", "--auth-file", str(home))
    assert out.returncode == 1 and "Is a directory" in out.stderr


def test_the_auth_file_is_trimmed_of_ascii_whitespace(home, monkeypatch):
    token = home / "token"
    token.write_bytes(b"\r\n\t abc def \x0c\n")
    opts = cli.Options(listen="0.0.0.0:1", auth_file=str(token))
    assert cli.fleet_token(opts) == b"abc def"


def test_the_default_token_is_read_from_superfluid_home(home, monkeypatch):
    write_token(home, b"secret\n")
    monkeypatch.setenv("SUPERFLUID_HOME", str(home / ".superfluid"))
    assert cli.fleet_token(cli.Options(listen="0.0.0.0:1")) == b"secret"
    monkeypatch.delenv("SUPERFLUID_HOME")
    monkeypatch.setenv("HOME", str(home))
    assert cli.superfluid_home() == home / ".superfluid"


def test_a_port_in_use_exits_1(home):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        out = noded(home, "--listen", listen, "--engine", "mock")
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == (
        f"superfluid-noded: bind {listen} failed: Address already in use (os error 98)"
    )


def test_an_address_that_does_not_resolve_exits_1(home):
    out = noded(home, "--listen", "no-such-host.invalid:8454", "--engine", "mock", "--insecure-no-auth")
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1].startswith("superfluid-noded: bind no-such-host.invalid:8454 failed: ")


def test_the_port_is_checked_before_the_model(home):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        out = noded(home, "--listen", f"127.0.0.1:{taken.getsockname()[1]}", "--model", "/no/such/model.base")
    assert out.returncode == 1 and "bind" in out.stderr


def test_a_missing_model_exits_3_and_names_it(home):
    out = noded(home, "--listen", "127.0.0.1:0", "--model", "/no/such/model.base")
    assert out.returncode == 3, out.stderr
    assert out.stderr.startswith("superfluid-noded: /no/such/model.base: no such file or directory")


def test_a_model_of_no_known_format_exits_3(home):
    (home / "weights.onnx").write_bytes(b"ONNX")
    out = noded(home, "--listen", "127.0.0.1:0", "--model", str(home / "weights.onnx"))
    assert out.returncode == 3 and "--runtime" in out.stderr


def test_a_damaged_gguf_file_exits_3_naming_it(home):
    (home / "weights.gguf").write_bytes(b"GGUF")
    out = noded(home, "--listen", "127.0.0.1:0", "--model", str(home / "weights.gguf"), timeout=60)
    assert out.returncode == 3, out.stderr
    assert "weights.gguf is not a readable GGUF file" in out.stderr


def test_a_cuda_device_this_torch_cannot_see_exits_3(home):
    pytest.importorskip("torch").cuda.is_available() and pytest.skip("this machine has CUDA")
    out = noded(home, "--listen", "127.0.0.1:0", "--model", "builtin", "--device", "cuda:0", timeout=60)
    assert out.returncode == 3, out.stderr
    assert "cuda:0" in out.stderr.splitlines()[-1]


def test_a_model_that_fails_to_load_exits_3(home):
    (home / "ckpt").mkdir()
    (home / "ckpt" / "config.json").write_text("{ not json")
    out = noded(home, "--listen", "127.0.0.1:0", "--model", str(home / "ckpt"), "--device", "cpu", timeout=60)
    assert out.returncode == 3, out.stderr
    assert out.stderr.splitlines()[-1].startswith("superfluid-noded: model load failed: ")


def test_parse_args_defaults_and_floors():
    opts = cli.parse_args(["--engine", "mock", "--max-batch", "0"])
    assert (opts.listen, opts.max_batch, opts.handshake_timeout_ms, opts.idle_timeout_ms) == (
        "0.0.0.0:8454", 1, 10_000, 30_000
    )
    assert (opts.drain_timeout_ms, opts.device, opts.runtime) == (30_000, "auto", "mock")
    assert cli.parse_args(["--runtime", "mock", "--max-context", "-3"]).max_context == -3


def test_the_identity_comes_from_the_flag_then_the_environment_then_the_host(monkeypatch):
    monkeypatch.setenv("SUPERFLUID_NODE_NAME", "from-env")
    assert cli.identity(cli.Options(identity="flag")) == "flag"
    assert cli.identity(cli.Options()) == "from-env"
    monkeypatch.delenv("SUPERFLUID_NODE_NAME")
    assert cli.identity(cli.Options()) == socket.gethostname()


def test_the_log_filter_reads_like_rust_log():
    assert logs.parse_filter("warn") == (logging.WARNING, {})
    assert logs.parse_filter("info,nodeagent::agent=debug, linkf=trace") == (
        logging.INFO,
        {"nodeagent.agent": logging.DEBUG, "linkf": logs.TRACE},
    )
    with pytest.raises(ValueError):
        logs.parse_filter("loud")
    assert logs.filter_from_env({"RUST_LOG": "debug"}) == "debug"
    assert logs.filter_from_env({"RUST_LOG": "debug", "SUPERFLUID_LOG": "warn"}) == "warn"
    assert logs.filter_from_env({}) == "info"


def test_a_log_line_looks_like_tracing_fmt():
    record = logging.LogRecord("nodeagent.agent", logging.WARNING, __file__, 1, "dropped %s", ("it",), None)
    record.fields = {"session": 3, "epoch": 7}
    line = logs.TracingFormatter().format(record)
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z  WARN nodeagent::agent: dropped it session=3 epoch=7", line
    ), line


def test_cuda_n_past_the_devices_there_is_a_load_error_naming_them(monkeypatch):
    torch = pytest.importorskip("torch")
    from nodeagent.daemon import ModelLoadError
    from nodeagent.engine import torch_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert torch_engine._resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ModelLoadError, match=r"'cuda:2' asked for, but this torch sees 2 CUDA device\(s\)"):
        torch_engine._resolve_device("cuda:2")


def test_the_flags_become_the_nodes_plain_config(tmp_path):
    from nodeagent.noded import NodeConfig

    opts = cli.parse_args([
        "--model", "builtin", "--model-name", "m", "--max-batch", "3", "--handshake-timeout-ms", "1500",
        "--idle-timeout-ms", "0", "--write-timeout-ms", "2500", "--drain-timeout-ms", "700",
        "--max-connections", "9", "--session-retention-ms", "1234", "--record", str(tmp_path),
        "--stream-interval-ms", "15",
    ])
    assert cli.node_config(opts) == NodeConfig(
        model_name="m", max_lanes=3, handshake_timeout_s=1.5, idle_timeout_s=0.0, write_timeout_s=2.5,
        drain_timeout_s=0.7, max_connections=9, session_retention_ms=1234, record=tmp_path,
        stream_interval_s=0.015,
    )
    assert cli.node_config(cli.parse_args(["--model", "builtin"])) == NodeConfig()
