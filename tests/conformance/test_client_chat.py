"""What `make run` then `superfluid-client generate 127.0.0.1:8454 --chat ...` does, with a
free port: the node serves the smollm2-135m-instruct alias as a real process, the client finds
the tokenizer from the model name the node advertises and prints the decoded answer."""

from __future__ import annotations

import pytest
from nodeproc import SERVING, Noded

from conformance import client
from proto.models import ALIASES, AliasUnavailable, alias_path

ALIAS = "smollm2-135m-instruct"
LOAD_TIMEOUT = 120.0

try:
    alias_path(ALIASES[ALIAS])
except AliasUnavailable as e:
    pytest.skip(str(e), allow_module_level=True)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    proc = Noded(["--listen", "127.0.0.1:0", "--model", ALIAS, "--max-batch", "2"], home, ready=None)
    try:
        proc.addr = SERVING.match(proc.wait_line(SERVING.pattern, LOAD_TIMEOUT)).group(3)
        yield proc
    finally:
        proc.kill()


def test_chat_with_no_model_flag_prints_a_sensible_answer(node, capsys):
    assert client.main(["generate", node.addr, "--chat", "What is the capital of France?", "--timeout", "60"]) == 0
    got = capsys.readouterr()
    assert got.out.strip() == "The capital of France is Paris."
    assert got.err.strip().startswith("finish EOS: 7 tokens in")


def test_text_prompt_is_continued_in_text(node, capsys):
    assert client.main(["generate", node.addr, "--text", "The capital of France is", "--max-new", "4", "--timeout", "60"]) == 0
    got = capsys.readouterr()
    assert "Paris" in got.out
    assert got.err.strip().startswith("finish LENGTH: 4 tokens in")


def test_a_model_name_with_no_tokenizer_here_is_a_usage_error_naming_it(node, capsys):
    code = client.main(["generate", node.addr, "--chat", "hi", "--model", "/nowhere/model", "--timeout", "60"])
    assert code == 2
    assert "/nowhere/model: no tokenizer found" in capsys.readouterr().err
