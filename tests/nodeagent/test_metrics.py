"""`--metrics-listen`: Prometheus text at /metrics and /health, scraped from a real
`superfluid-noded` process while a test head drives it (issue 12)."""

from __future__ import annotations

import re
import signal
import socket
import urllib.error
import urllib.request

from helpers import http_get
from polling import wait_until
from prometheus_client.parser import text_string_to_metric_families

from conformance.head import FleetHead
from conformance.raw import hung_up, raw_connect
from conformance.reference import mock_tokens
from linkf.errors import LinkFError
from proto import finish

MOCK = ("--listen", "127.0.0.1:0", "--engine", "mock", "--metrics-listen", "127.0.0.1:0")
METRICS_LINE = r"^superfluid-noded: metrics at http://(\S+)/metrics, health at /health, readiness at /ready$"
PROMPT = list(range(100, 130))


def metrics_addr(node) -> str:
    return re.match(METRICS_LINE, node.wait_line(METRICS_LINE)).group(1)


def scrape(addr: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_counters_move_by_what_the_generations_did(noded):
    node = noded(*MOCK, "--token-delay-ms", "20")
    addr = metrics_addr(node)
    assert http_get(addr, "/health") == (200, "serving\n")
    assert http_get(addr, "/ready") == (200, "serving\n")
    before = scrape(addr)
    assert value(before, "superfluid_node_generation_tokens_total") == 0
    assert value(before, "superfluid_node_kv_blocks_total") > 0
    with FleetHead.connect(node.addr) as head:
        head.assign(1)
        head.append(1, PROMPT)
        req = head.request(1, 50)  # about 1 s at 20 ms a token
        head.until(lambda: head.generations.get((1, req.generation_id)), 5, "the first tokens")
        during = scrape(addr)  # the node observes each event before it sends it
        sent = value(during, "superfluid_node_generation_tokens_total")
        assert 0 < sent < 50
        assert value(during, "superfluid_node_prompt_tokens_total") == len(PROMPT)
        assert value(during, "superfluid_node_generations_running") == 1
        assert value(during, "superfluid_node_lanes_running") == 1
        assert value(during, "superfluid_node_connections_open") == 1
        assert value(during, "superfluid_node_sessions_held") == 1
        assert value(during, "superfluid_node_time_to_first_token_seconds_count") == 1
        gen = head.collect(req)
        assert gen.finish == finish.LENGTH and gen.tokens == mock_tokens(PROMPT, 50)

        second = head.request(1, 7)
        declined = head.request(1, 5)  # while the second runs on this connection: declined
        assert head.collect(declined).finish == finish.DECLINED
        assert head.collect(second).tokens == mock_tokens(PROMPT, 7)
        after = scrape(addr)
    assert value(after, "superfluid_node_generation_tokens_total") == 57
    assert value(after, "superfluid_node_prompt_tokens_total") == 2 * len(PROMPT)
    assert value(after, "superfluid_node_generations_finished_total", reason="length") == 2
    assert value(after, "superfluid_node_generations_finished_total", reason="declined") == 1
    assert value(after, "superfluid_node_generations_running") == 0
    assert value(after, "superfluid_node_lanes_running") == 0
    assert value(after, "superfluid_node_time_to_first_token_seconds_count") == 2
    assert value(after, "superfluid_node_inter_token_latency_seconds_count") >= 2
    assert value(after, "superfluid_node_kv_blocks_used") == 0
    assert value(after, "superfluid_node_info", identity=node.identity, model="mock", version=value_version(after)) == 1
    assert node.stop() == 0


def value_version(samples) -> str:
    (labels,) = [dict(k[1]) for k in samples if k[0] == "superfluid_node_info"]
    return labels["version"]


def test_refused_handshakes_are_counted_by_reason(noded, tmp_path):
    (tmp_path / "token").write_text("right")
    node = noded(*MOCK, "--auth-file", str(tmp_path / "token"), "--handshake-timeout-ms", "2000")
    addr = metrics_addr(node)
    try:
        FleetHead.connect(node.addr, auth=b"wrong", timeout=3).close()
    except LinkFError:
        pass
    node.wait_line("its fleet token differs")
    with FleetHead.connect(node.addr, auth=b"right") as head:
        # The node counts the connection once its HELLO_ACK has left: a moment after the head has it.
        assert wait_until(lambda: value(scrape(addr), "superfluid_node_connections_open") == 1)
        head.assign(5)
    node.wait_line("head connection closed")
    samples = scrape(addr)
    assert value(samples, "superfluid_node_handshakes_refused_total", reason="token") == 1
    assert value(samples, "superfluid_node_connections_open") == 0
    assert value(samples, "superfluid_node_sessions_held") == 1, "a session outlives its connection"


def test_the_node_is_not_ready_but_alive_while_it_drains(noded):
    node = noded(*MOCK, "--token-delay-ms", "20")
    addr = metrics_addr(node)
    with FleetHead.connect(node.addr) as head:
        head.assign(1)
        head.append(1, PROMPT)
        req = head.request(1, 60)  # about 1.2 s
        head.until(lambda: head.generations.get((1, req.generation_id)), 5, "the first tokens")
        node.proc.send_signal(signal.SIGTERM)
        node.wait_line("draining")
        assert http_get(addr, "/ready") == (503, "draining\n")
        assert http_get(addr, "/health") == (200, "draining\n")
        assert value(scrape(addr), "superfluid_node_generations_running") == 1, "metrics still answer"
        assert head.collect(req).finish == finish.LENGTH
    assert node.wait() == 0


def test_the_story_of_a_connection_is_told_at_info(noded):
    node = noded("--listen", "127.0.0.1:0", "--engine", "mock")
    with FleetHead.connect(node.addr) as head:
        head.assign(3)
        head.append(3, [1, 2, 3])
        head.generate(3, 4)
        head.revoke(3)
        node.wait_line(r"INFO nodeagent::story: session revoked session=3$")
    node.wait_line(r"INFO nodeagent::story: head connection closed peer=127\.0\.0\.1:\d+ reason=")
    assert node.stop() == 0
    story = [line.split(": ", 1)[1] for line in node.lines if "nodeagent::story" in line]
    assert re.fullmatch(r"head connected peer=127\.0\.0\.1:\d+", story[0])
    assert re.fullmatch(r"session assigned session=3 epoch=\d+", story[1])
    assert re.fullmatch(r"generation finished session=3 generation=1 tokens=4 tokens_per_s=[\d.]+ reason=length", story[2])


def test_a_peer_speaking_http_is_told_apart(noded):
    node = noded("--listen", "127.0.0.1:0", "--engine", "mock")
    host, _, port = node.addr.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert hung_up(sock, 5)
    line = node.wait_line("speaks HTTP")
    assert "this port speaks Link F" in line and "542393671" not in line
    with raw_connect(node.addr) as sock:
        sock.sendall(bytes([0x16, 0x03, 0x01, 0x02, 0x00]) + bytes(64))  # a TLS ClientHello's start
        assert hung_up(sock, 5)
    assert "this port speaks Link F" in node.wait_line("speaks TLS")


def test_a_keyed_node_tells_http_apart_before_its_noise_handshake(noded, tmp_path):
    (tmp_path / "token").write_text("tok")
    node = noded("--listen", "127.0.0.1:0", "--engine", "mock", "--auth-file", str(tmp_path / "token"))
    with raw_connect(node.addr) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert hung_up(sock, 5)
    line = node.wait_line("speaks HTTP")
    assert line.startswith("superfluid-noded: a connection from 127.0.0.1:") and "this port speaks Link F" in line
