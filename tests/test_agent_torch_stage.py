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
def test_tokens_the_engine_sends_itself_arrive_in_order_and_token_exact(start_node, monkeypatch, noise):
    """The scheduler sends a step's tokens to the head itself when nothing waits before them
    (`Connection.send_direct`); whether a batch went that way or through the loop, the head
    reads the greedy tokens in order, on a plain link and a Noise one."""
    from nodeagent.agent import Connection

    daemon = TorchDaemon(random_model(TINY, 7, torch.float32, torch.device("cpu")), "tiny", max_batch=2, kv_blocks=64)
    node = start_node(daemon, model="tiny", auth=b"k" * 32 if noise else b"")
    direct = []
    send_direct = Connection.send_direct

    def counted(self, *args):
        sent = send_direct(self, *args)
        direct.append(sent)
        return sent

    monkeypatch.setattr(Connection, "send_direct", counted)
    with FleetHead.connect(node.addr, auth=b"k" * 32 if noise else b"") as head:
        head.assign(1, GenParams())
        head.append(1, PROMPT)
        generated = head.generate(1, 40).tokens
    greedy = daemon.generate_tokens_streaming(PROMPT, GenParams(), 40, 0, GenExtras(), lambda b: True).tokens
    assert generated == greedy and len(greedy) == 40
    assert any(direct), "the engine's thread sent some tokens itself"
