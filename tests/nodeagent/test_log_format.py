"""--log-format json, and the `superfluid-noded:` lines going through the same logging as the
rest (issue 12): the Rust wording in the text format, JSON in the JSON format, silent at off."""

from __future__ import annotations

import json
import socket
import time

from nodeproc import SERVING

from conformance.head import FleetHead
from linkf.errors import LinkFError

MOCK = ("--listen", "127.0.0.1:0", "--engine", "mock")


def test_json_lines_carry_the_console_lines_and_the_story(noded):
    node = noded(*MOCK, "--log-format", "json", ready=None)
    line = node.wait_line(r'"message": "node \'')
    with_addr = json.loads(line)
    assert with_addr["target"] == "superfluid-noded" and with_addr["level"] == "INFO"
    addr = SERVING.match(f"superfluid-noded: {with_addr['message']}").group(3)
    with FleetHead.connect(addr) as head:
        head.assign(4)
        head.append(4, [1, 2])
        head.generate(4, 3)
        finished = json.loads(node.wait_line("generation finished"))
    assert finished["target"] == "nodeagent::story"
    assert (finished["session"], finished["tokens"], finished["reason"]) == (4, 3, "length")
    assert node.stop() == 0
    for line in node.lines:
        entry = json.loads(line)  # every line is one JSON object
        assert {"timestamp", "level", "target", "message"} <= entry.keys()


def test_off_silences_even_the_console_lines(noded):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    node = noded("--listen", f"127.0.0.1:{port}", "--engine", "mock", SUPERFLUID_LOG="off", ready=None)
    # No serving line to wait for: the node is up once a head gets in.
    deadline = time.monotonic() + 20
    while True:
        try:
            FleetHead.connect(f"127.0.0.1:{port}", timeout=1).close()
            break
        except (LinkFError, OSError):
            assert time.monotonic() < deadline and node.proc.poll() is None, node.lines
            time.sleep(0.1)
    assert node.stop() == 0
    assert node.lines == []


def test_warn_still_shows_the_lines_tools_scrape(noded):
    node = noded(*MOCK, SUPERFLUID_LOG="warn")
    assert node.lines[0].startswith("superfluid-noded: runtime mock")
    assert node.stop() == 0
