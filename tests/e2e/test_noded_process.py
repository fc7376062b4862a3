"""The node-agent PROCESS end to end: `superfluid-noded` started as a real process, driven by a
test head over real TCP (port of the Rust `fleet_noded_process.rs`, plus the drain, the token,
the logging and the connection limits this port adds)."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time

import pytest
from polling import wait_until

from conformance.head import FleetHead
from conformance.raw import hung_up, raw_connect, raw_frame
from linkf.errors import LinkFError
from proto import finish
from nodeagent.daemon import GenExtras
from nodeagent.engine.mock import MockDaemon
from proto.params import GenParams


def local_mock(prompt, max_new, seed=0):
    result = MockDaemon().generate_tokens_streaming(prompt, GenParams(seed=seed), max_new, 0, GenExtras(), bool)
    return list(result.tokens)


MOCK = ("--listen", "127.0.0.1:0", "--engine", "mock")


def test_noded_process_serves_a_fleet_generation(noded):
    prompt = list(range(500, 540))
    node = noded(*MOCK, "--identity", "proc-node")
    assert (node.identity, node.model_name) == ("proc-node", "mock")
    assert node.lines[0] == "superfluid-noded: runtime mock, context window 4096 tokens, 8 lanes"
    with FleetHead.connect(node.addr) as head:
        assert head.node.node_identity == "proc-node"
        assert head.node.loadable_models == ["mock"]
        assert (head.node.capacity.max_context_tokens, head.node.capacity.max_lanes) == (4096, 8)
        head.assign(3, GenParams(seed=11))
        head.append(3, prompt)
        gen = head.generate(3, 12)
        assert gen.finish == finish.LENGTH
        assert gen.tokens == local_mock(prompt, 12, seed=11), "noded process diverged from local"
        answer = head.stage([1, 2, 3], 0, 24)
        assert answer.token == MockDaemon().forward_stage([1, 2, 3], 0, 24, None).token
    assert node.proc.poll() is None


def test_flags_reach_the_capacity_and_the_name(noded):
    node = noded(*MOCK, "--max-batch", "3", "--max-context", "100", "--model-name", "alias", "--identity", "n2")
    assert node.lines[0] == "superfluid-noded: runtime mock, context window 512 tokens, 3 lanes"
    with FleetHead.connect(node.addr) as head:
        assert head.node.loadable_models == ["alias"]
        assert (head.node.capacity.max_context_tokens, head.node.capacity.max_lanes) == (512, 3)


def test_the_identity_defaults_to_the_environment(noded):
    node = noded(*MOCK, SUPERFLUID_NODE_NAME="env-node")
    assert node.identity == "env-node"
    with FleetHead.connect(node.addr) as head:
        assert head.node.node_identity == "env-node"


def test_a_token_encrypts_the_link_and_refuses_another(noded, tmp_path):
    (tmp_path / "token").write_text("  s3cret-token \n")
    node = noded(*MOCK, "--auth-file", str(tmp_path / "token"), "--handshake-timeout-ms", "2000")
    node.wait_line("^superfluid-noded: the link is encrypted and both ends are checked against the token$")
    with pytest.raises(LinkFError):
        FleetHead.connect(node.addr, auth=b"another-token", timeout=3)
    node.wait_line(r"^superfluid-noded: refused 127\.0\.0\.1:\d+: its fleet token differs$")
    with FleetHead.connect(node.addr, auth=b"s3cret-token") as head:
        head.assign(1)
        head.append(1, [1, 2, 3])
        assert head.generate(1, 5).tokens == local_mock([1, 2, 3], 5)


def test_the_default_token_lets_it_serve_off_loopback(noded, tmp_path):
    token = tmp_path / ".superfluid" / "fleet" / "token"
    token.parent.mkdir(parents=True)
    token.write_text("fleet-tok\n")
    node = noded("--listen", "0.0.0.0:0", "--engine", "mock")
    assert node.lines[0] == f"superfluid-noded: fleet token from {token}"
    port = node.addr.rpartition(":")[2]
    assert node.addr == f"0.0.0.0:{port}" and port != "0"
    with FleetHead.connect(f"127.0.0.1:{port}", auth=b"fleet-tok") as head:
        assert head.node.node_identity == node.identity


def test_a_broken_peer_costs_one_line_and_only_its_own_link(noded):
    node = noded(*MOCK, "--token-delay-ms", "5")
    with FleetHead.connect(node.addr) as head:
        head.assign(1)
        head.append(1, list(range(20)))
        req = head.request(1, 60)
        with raw_connect(node.addr) as bad:
            bad.sendall(raw_frame(0x0001, b"\x00"))  # a HELLO that does not decode
            assert hung_up(bad, 5)
        line = node.wait_line(r"connection from 127\.0\.0\.1:\d+")
        assert re.match(r"^superfluid-noded: the connection from 127\.0\.0\.1:\d+ ended: \S", line), line
        assert "(peer" not in line, "the peer is named once"
        assert head.collect(req).tokens == local_mock(list(range(20)), 60)
    assert node.proc.poll() is None


def test_the_serving_line_names_a_port_that_answers(noded):
    node = noded(*MOCK)
    host, _, port = node.addr.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    with socket.create_connection((host, int(port)), timeout=5):
        pass


def test_sigterm_drains_a_running_generation_then_exits_0(noded):
    node = noded(*MOCK, "--token-delay-ms", "20")
    prompt = [7] * 30
    with FleetHead.connect(node.addr) as head:
        head.assign(1)
        head.append(1, prompt)
        req = head.request(1, 60)  # about 1.2 s at 20 ms a token
        head.until(lambda: head.generations.get((1, req.generation_id)), 5, "the first tokens")
        node.proc.send_signal(signal.SIGTERM)
        node.wait_line("draining")
        with pytest.raises(OSError):
            socket.create_connection(tuple(_split(node.addr)), timeout=2).close()
        gen = head.collect(req)
        assert gen.finish == finish.LENGTH and gen.tokens == local_mock(prompt, 60)
    assert node.wait() == 0
    assert "superfluid-noded: draining: no new connections; 1 generation(s) running, waiting up to 30 s" in node.lines
    assert node.lines[-1] == "superfluid-noded: drained; exiting"


def test_the_drain_is_bounded_by_its_timeout(noded):
    node = noded(*MOCK, "--token-delay-ms", "20", "--drain-timeout-ms", "300")
    with FleetHead.connect(node.addr) as head:
        head.assign(1)
        head.append(1, [1])
        req = head.request(1, 100_000)
        head.until(lambda: head.generations.get((1, req.generation_id)), 5, "the first tokens")
        start = time.monotonic()
        assert node.stop(signal.SIGINT) == 0
        assert time.monotonic() - start < 3
    assert "superfluid-noded: drain ended with 1 generation(s) still running; stopping them" in node.lines


def test_an_idle_node_exits_0_at_once_on_sigterm(noded):
    node = noded(*MOCK)
    start = time.monotonic()
    assert node.stop() == 0 and time.monotonic() - start < 3


def test_log_levels_follow_superfluid_log_then_rust_log(noded):
    accepted = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z DEBUG nodeagent::noded: accepted a connection from 127\.0\.0\.1:\d+$"
    silent = r"^\d{4}-\d\d-\d\dT[\d:.]+Z  WARN nodeagent::agent: node-agent dropped a silent connection \(no Hello\)"
    debug = noded(*MOCK, "--handshake-timeout-ms", "200", RUST_LOG="debug")
    info = noded(*MOCK, "--handshake-timeout-ms", "200")
    quiet = noded(*MOCK, "--handshake-timeout-ms", "200", RUST_LOG="debug", SUPERFLUID_LOG="error")
    for node in (debug, info, quiet):
        with raw_connect(node.addr) as sock:
            assert hung_up(sock, 5)  # said nothing: dropped after the handshake timeout
    debug.wait_line(accepted)
    debug.wait_line(silent)
    info.wait_line(silent)
    for node in (debug, info, quiet):
        assert node.stop() == 0
    assert not any(re.match(accepted, line) for line in info.lines)
    assert not any(re.search(r"Z +(DEBUG|INFO|WARN) ", line) for line in quiet.lines), quiet.lines


def test_one_source_holds_at_most_16_handshakes_and_a_head_still_gets_in(noded, tmp_path):
    (tmp_path / "token").write_text("tok")
    node = noded(*MOCK, "--auth-file", str(tmp_path / "token"), "--handshake-timeout-ms", "1500")
    socks = [raw_connect(node.addr) for _ in range(70)]
    try:
        # The newest 16 are held; each newcomer let the oldest of its source go.
        assert wait_until(lambda: sum(map(closed_now, socks[:54])) == 54)
        assert [closed_now(s) for s in socks] == [True] * 54 + [False] * 16
        with FleetHead.connect(node.addr, auth=b"tok", timeout=1) as head:
            assert head.node.node_identity == node.identity
    finally:
        for s in socks:
            s.close()


def test_two_heads_at_once_each_get_their_own_tokens(noded):
    node = noded(*MOCK, "--token-delay-ms", "2")
    results = {}

    def run(session, prompt):
        with FleetHead.connect(node.addr) as head:
            head.assign(session)
            head.append(session, prompt)
            results[session] = head.generate(session, 40).tokens

    threads = [threading.Thread(target=run, args=(s, list(range(s, s + 9)))) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {s: local_mock(list(range(s, s + 9)), 40) for s in (1, 2)}


def test_a_cancel_reaches_the_process(noded):
    node = noded(*MOCK, "--token-delay-ms", "10")
    with FleetHead.connect(node.addr) as head:
        head.assign(1)
        head.append(1, [4, 5])
        req = head.request(1, 100_000)
        head.until(lambda: head.generations.get((1, req.generation_id)), 5, "the first tokens")
        head.cancel(req)
        gen = head.collect(req, timeout=5)
        assert gen.finish == finish.CANCELLED
        assert gen.tokens == local_mock([4, 5], len(gen.tokens))


def closed_now(sock: socket.socket) -> bool:
    """Whether the peer has already closed `sock` (without waiting for it to)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def _split(addr: str):
    host, _, port = addr.rpartition(":")
    return host, int(port)


def test_the_builtin_torch_model_serves_what_it_serves_in_process(noded):
    from nodeagent.engine.torch_engine import TorchDaemon

    args = ("--listen", "127.0.0.1:0", "--model", "builtin", "--device", "cpu", "--max-batch", "2")
    # The node picks its own thread count, whatever the shell running the tests set.
    node = noded(*args, OMP_NUM_THREADS=None, MKL_NUM_THREADS=None)
    assert node.lines[0].startswith("superfluid-noded: runtime torch (builtin, llama, cpu")
    threads = int(re.search(r", (\d+) CPU threads?, ", node.lines[0]).group(1))
    assert 1 <= threads <= len(os.sched_getaffinity(0)), "the scheduler's threads fit the CPUs allowed"
    assert node.model_name == "builtin"
    prompt = [11, 22, 33, 44, 55]
    local = TorchDaemon.load("builtin", device="cpu", max_batch=1)
    try:
        want = local.generate_tokens_streaming(prompt, GenParams(), 8, 0, GenExtras(), lambda b: True).tokens
    finally:
        local.close()
    with FleetHead.connect(node.addr) as head:
        assert head.node.capacity.max_lanes == 2
        head.assign(1)
        head.append(1, prompt)
        gen = head.generate(1, 8, timeout=30)
    assert gen.tokens == want and gen.finish in (finish.LENGTH, finish.EOS)
    assert node.stop() == 0


def test_a_cold_kernel_cache_is_built_at_load_not_in_the_first_watched_step(noded, tmp_path):
    from nodeagent.engine.cpu_kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no CPU kernels build here")
    args = ("--listen", "127.0.0.1:0", "--model", "builtin", "--device", "cpu", "--engine-stall-timeout-ms", "1000")
    node = noded(*args, XDG_CACHE_HOME=str(tmp_path / "cold-cache"))
    assert "attended in place on the node's" in node.lines[0]
    assert list((tmp_path / "cold-cache" / "superfluid").glob("cpu_kernels-*.so")), "built into the cold cache"
    with FleetHead.connect(node.addr) as head:
        head.assign(1)
        head.append(1, [1, 2, 3])
        gen = head.generate(1, 8, timeout=30)
    assert gen.finish == finish.LENGTH and len(gen.tokens) == 8
