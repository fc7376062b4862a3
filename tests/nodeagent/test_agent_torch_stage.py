"""Stage forwards of the torch engine over the wire, through the agent: for every split k,
`[0,k)` then `[k,n)` gives the token `[0,n)` gives, with the hidden state crossing the link as
little-endian float32 `[positions, hidden]` (README, protocol notes)."""

import numpy as np
import pytest
import torch
from tinymodel import TINY

from conformance.head import FleetHead
from nodeagent.daemon import GenExtras
from nodeagent.engine.builtin import random_model
from nodeagent.engine.torch_engine import TorchDaemon
from proto.params import GenParams

PROMPT = [3, 14, 159, 26, 53, 58, 97]


@pytest.fixture
def torch_node(start_node):
    daemon = TorchDaemon(random_model(TINY, 7, torch.float32, torch.device("cpu")), "tiny", max_batch=2, kv_blocks=64)
    return start_node(daemon, model="tiny")


def test_every_split_over_the_wire_gives_the_token_of_the_whole(torch_node):
    n = TINY.n_layers
    with FleetHead.connect(torch_node.addr) as head:
        whole = head.stage(PROMPT, 0, n)
        assert whole.hidden is None and whole.token is not None
        for k in range(n):
            first = head.stage(PROMPT, 0, k)
            assert first.token is None
            assert len(first.hidden) == len(PROMPT) * TINY.hidden_size * 4, f"split {k}: [positions, hidden] f32"
            second = head.stage([], k, n, first.hidden)
            assert (second.hidden, second.token) == (None, whole.token), f"split at layer {k}"


def test_the_wire_carries_the_engine_s_hidden_state_and_greedy_token(torch_node):
    daemon = torch_node.daemon
    with FleetHead.connect(torch_node.addr) as head:
        wired = np.frombuffer(head.stage(PROMPT, 0, 2).hidden, dtype="<f4").reshape(len(PROMPT), TINY.hidden_size)
        local = np.frombuffer(daemon.forward_stage(PROMPT, 0, 2, None).data, dtype="<f4")
        assert np.array_equal(wired.reshape(-1), local)
        token = head.stage(PROMPT, 0, TINY.n_layers).token
        head.assign(1, GenParams())
        head.append(1, PROMPT)
        generated = head.generate(1, 1).tokens
    greedy = daemon.generate_tokens_streaming(PROMPT, GenParams(), 1, 0, GenExtras(), lambda b: True).tokens
    assert generated == greedy == [token], "the last stage answers the greedy next token"


@pytest.mark.parametrize(
    "tokens, start, end, hidden",
    [
        (PROMPT, 3, 2, None),
        (PROMPT, 0, TINY.n_layers + 1, None),
        ([], 2, TINY.n_layers, b"\x00" * 12),
        ([], 0, TINY.n_layers, None),
    ],
)
def test_a_stage_the_torch_engine_cannot_run_is_answered_empty(torch_node, tokens, start, end, hidden):
    with FleetHead.connect(torch_node.addr) as head:
        answer = head.stage(tokens, start, end, hidden)
        assert (answer.hidden, answer.token) == (None, None)
        assert head.stage(PROMPT, 0, TINY.n_layers).token is not None, "the connection serves on"


@pytest.mark.parametrize("noise", [False, True], ids=["plain", "noise"])
def test_every_send_and_receive_on_a_socket_runs_on_one_thread(start_node, monkeypatch, noise):
    """The design card's thread shape: the scheduler hands its tokens over and only each
    connection's own thread touches that connection's socket. Every socket call of the link
    code is recorded with its thread while two heads stream greedy tokens at once, on a plain
    link and a Noise one; the tokens are the engine's own."""
    import threading

    from linkf import gil_held

    threads_of: dict[int, set[str]] = {}
    sockets: list = []  # held, so that no id is reused while the test runs

    def recorded(name):
        call = getattr(gil_held, name)

        def wrapper(sock, *args):
            sockets.append(sock)
            threads_of.setdefault(id(sock), set()).add(threading.current_thread().name)
            return call(sock, *args)

        return wrapper

    for name in ("send", "recv"):
        monkeypatch.setattr(gil_held, name, recorded(name))
    daemon = TorchDaemon(random_model(TINY, 7, torch.float32, torch.device("cpu")), "tiny", max_batch=2, kv_blocks=64)
    auth = b"k" * 32 if noise else b""
    node = start_node(daemon, model="tiny", auth=auth)
    generated = {}

    def stream(i: int) -> None:
        with FleetHead.connect(node.addr, auth=auth) as head:
            head.assign(1 + i, GenParams())  # sessions are node-wide: one each
            head.append(1 + i, PROMPT[i:])
            generated[i] = head.generate(1 + i, 40).tokens

    heads = [threading.Thread(target=stream, args=(i,), name=f"head-{i}") for i in range(2)]
    for t in heads:
        t.start()
    for t in heads:
        t.join(60)
    for i in range(2):
        want = daemon.generate_tokens_streaming(PROMPT[i:], GenParams(), 40, 0, GenExtras(), lambda b: True).tokens
        assert generated[i] == want and len(want) == 40
    assert len(threads_of) >= 4, "two heads' sockets and the node's two"
    shared = {sock: names for sock, names in threads_of.items() if len(names) > 1}
    assert shared == {}, "a socket was used from more than one thread"
    assert not any(name.startswith("torch-scheduler") for names in threads_of.values() for name in names)
