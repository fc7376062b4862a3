"""The kit's head client and `superfluid-client`: every wait bounded by its own exception, heads
that share nothing, streaming, and the client's three commands against a real node."""

import ast
import re
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from polling import TIMEOUT, background

from conformance import cli, client
from conformance.head import FleetHead, HeadTimeout
from conformance.reference import mock_tokens
from conformance.suite import select
from linkf.driver import Endpoint
from proto.params import GenParams
from proto.handshake import CapacitySummary, HelloAckF
from proto.linkf import LinkFLimits, msg_type

ACK = HelloAckF(
    chosen_version=3,
    node_identity="mute",
    capacity=CapacitySummary(max_sessions=8, max_context_tokens=4096),
    loadable_models=["mock"],
    limits=LinkFLimits(max_frame=16 << 20, transfer_window=8, max_transfer=1 << 26, transfer_budget=1 << 28),
)


@pytest.fixture
def mute_node():
    """A node that answers HELLO, then reads everything and answers nothing."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT)
    stop = threading.Event()

    def serve():
        sock, _ = listener.accept()
        with Endpoint.from_tcp(sock) as ep:
            ep.answer_hello_as_agent(ACK, b"", TIMEOUT)
            while not stop.is_set():
                try:
                    ep.pump()
                except Exception:  # the head hung up
                    return

    done = background(serve)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    done()
    listener.close()


def test_a_silent_node_is_a_timeout_that_names_what_was_awaited(mute_node):
    assert not issubclass(HeadTimeout, AssertionError)
    with FleetHead.connect(mute_node) as head:
        head.assign(1)
        head.append(1, [1, 2])
        start = time.monotonic()
        with pytest.raises(HeadTimeout, match="no Finish for session 1 generation 1 from the node within 0.3 s"):
            head.generate(1, 4, timeout=0.3)
        with pytest.raises(HeadTimeout, match="stage answer"):
            head.stage([1], 0, 24, timeout=0.2)
        with pytest.raises(HeadTimeout, match="tokens or a Finish"):
            list(head.generate_streaming(1, 4, timeout=0.2))
        with pytest.raises(HeadTimeout, match="no RECONCILE_ACK from the node"):
            head.wait_for(msg_type.RECONCILE_ACK, 0.2)
        assert time.monotonic() - start < 3


def test_two_heads_in_one_process_share_no_epochs_or_commands(node):
    with FleetHead.connect(node.addr) as a, FleetHead.connect(node.addr) as b:
        epochs_a = [a.assign(s) for s in (1, 2, 3)]
        epochs_b = [b.assign(s) for s in (11, 12)]
        epochs_a.append(a.assign(4))
        assert epochs_a == list(range(epochs_a[0], epochs_a[0] + 4)), "a head's epochs are its own"
        assert not set(epochs_a) & set(epochs_b)
        commands_a = {a.session.next_command(1) for _ in range(3)}
        commands_b = {b.session.next_command(11) for _ in range(3)}
        assert not commands_a & commands_b
        assert a.next_id() == b.next_id() == 1, "generation ids count per head, as the Rust head's"


def test_streaming_yields_the_tokens_as_they_come(node):
    with FleetHead.connect(node.addr) as head:
        head.assign(5, GenParams(seed=3))
        head.append(5, [4, 5, 6])
        runs = list(head.generate_streaming(5, 40))
        assert [t for run in runs for t in run] == mock_tokens([4, 5, 6], 40, seed=3)
        assert head.generations[(5, 1)].finish == 2


def test_the_client_says_hello_status_and_generates(node, capsys):
    assert client.main(["hello", node.addr]) == 0
    out = capsys.readouterr().out
    assert "node        node-a" in out and "models      mock" in out and "window      4096 tokens" in out
    assert re.search(r"^memory      no GPU, host \d+(\.\d+)? GiB$", out, re.M), out
    assert client.main(["status", node.addr, "--timeout", "5"]) == 0
    assert "kv blocks" in capsys.readouterr().out
    assert client.main(["generate", node.addr, "--prompt", "1,2,3", "--max-new", "12"]) == 0
    got = capsys.readouterr()
    assert got.out.split() == [str(t) for t in mock_tokens([1, 2, 3], 12)]
    assert got.err.strip().startswith("finish LENGTH: 12 tokens in")



@pytest.mark.parametrize(
    "n, shown",
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"), (25 * 2**30 + 2**29, "25.5 GiB"), (512 * 2**20, "512 MiB")],
)
def test_memory_reads_in_binary_units(n, shown):
    assert client.human_bytes(n) == shown


def test_a_node_with_a_gpu_says_what_is_free():
    c = SimpleNamespace(gpu_memory_bytes=80 * 2**30, gpu_memory_free_bytes=60 * 2**30)
    assert client.gpu_memory(c) == "GPU 60.0 GiB free of 80.0 GiB"


def test_the_client_fails_with_one_line_when_no_node_answers(capsys):
    with socket.create_server(("127.0.0.1", 0)) as closed:
        addr = f"127.0.0.1:{closed.getsockname()[1]}"
    assert client.main(["hello", addr, "--timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"superfluid-client: {addr}: ") and err.count("\n") == 1


def test_the_kit_never_imports_the_nodes_agent_or_engine():
    """A kit that checked the node with the node's own code would prove nothing."""
    code = (
        "import sys, conformance.cli, conformance.client, conformance.suite, conformance.replay; "
        "print(sorted(m for m in sys.modules if m.startswith(('nodeagent', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    loaded = ast.literal_eval(out.stdout)
    forbidden = ("nodeagent.agent", "nodeagent.engine", "nodeagent.daemon", "torch")
    assert not [m for m in loaded if m.startswith(forbidden)], loaded


def test_the_conformance_command_lists_its_scenarios_and_refuses_unknown_ones(capsys):
    assert cli.main(["127.0.0.1:1", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [s.name for s in select(None)] and len(listed) >= 39 and listed[0] == "hello-ack"
    assert cli.main(["127.0.0.1:1", "--only", "cancel,no-such-thing"]) == 2
    assert capsys.readouterr().err == "superfluid-conformance: no scenario named no-such-thing (see --list)\n"
    assert cli.main(["127.0.0.1:1", "--auth-file", "/nonexistent/token"]) == 2
    assert "cannot read --auth-file /nonexistent/token" in capsys.readouterr().err
