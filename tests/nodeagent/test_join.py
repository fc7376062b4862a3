"""`superfluid-noded join HEAD:PORT`: the node dials a head listening on loopback, one
connection per lane, and the head adopts each as it would a node it dialled (it opens Noise
and says HELLO). A real node process, a test head of the conformance kit (issue 12)."""

from __future__ import annotations

import re
import socket
import stat
import threading
import time

import pytest

from conformance.head import Dial, FleetHead, clock_id
from conformance.reference import mock_tokens
from linkf.driver import Endpoint, Liveness
from linkf.secure import NoiseRole
from proto import finish
from nodeagent.join import REFUSED, Backoff
from proto.handshake import LinkRole

JOIN_LINE = re.compile(r"^superfluid-noded: node '.*' serves mock; dialing the head at \S+ once per lane \(\d+\)$")
ADOPT_TIMEOUT = 10.0


class HeadListener:
    """A head that takes nodes that dial in: each accepted connection becomes a `FleetHead`."""

    def __init__(self, auth: bytes = b"", port: int = 0) -> None:
        self.auth = auth
        self.heads: list[FleetHead] = []
        self.accepted_at: list[float] = []
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", port))
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._adopt, args=(sock,), daemon=True).start()

    def _adopt(self, sock: socket.socket) -> None:
        """The head's side of a dialled-in link: Noise initiator (with a token), then HELLO."""
        peer = "%s:%d" % sock.getpeername()
        try:
            if self.auth:
                endpoint = Endpoint.from_tcp_secure(sock, self.auth, NoiseRole.Initiator, 5.0)
            else:
                endpoint = Endpoint.from_tcp(sock)
            node = endpoint.hello_as_head(self.auth, 5.0)
        except Exception:  # noqa: BLE001 - a node with another token: the node's side is tested
            sock.close()
            return
        endpoint.keep_alive(Liveness(heartbeat=5.0, silence=0.0))
        dial = Dial(peer, self.auth, bool(self.auth), (2, 3), LinkRole.HeadDaemon, 5.0)
        start = clock_id()
        with self._lock:
            self.heads.append(FleetHead(endpoint, node, dial, start, start * 16))
            self.accepted_at.append(time.monotonic())

    def wait_heads(self, count: int, timeout: float = ADOPT_TIMEOUT) -> list[FleetHead]:
        deadline = time.monotonic() + timeout
        while len(self.heads) < count:
            assert time.monotonic() < deadline, f"{len(self.heads)} of {count} lanes joined within {timeout} s"
            time.sleep(0.02)
        return list(self.heads)

    def close(self) -> None:
        """The head goes away: no listener, every link closed."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept, which a close alone does not
        except OSError:
            pass
        self._sock.close()
        self._thread.join(5)
        for head in self.heads:
            head.close()


@pytest.fixture
def heads():
    made: list[HeadListener] = []

    def start(auth: bytes = b"", port: int = 0) -> HeadListener:
        made.append(HeadListener(auth, port))
        return made[-1]

    yield start
    for head in made:
        head.close()


def serve_one_generation_on_each(lanes: list[FleetHead], first_session: int) -> None:
    for i, head in enumerate(lanes):
        session = first_session + i
        prompt = [session, 7, 9]
        head.assign(session)
        head.append(session, prompt)
        gen = head.generate(session, 6)
        assert gen.finish == finish.LENGTH and gen.tokens == mock_tokens(prompt, 6)


def test_a_joining_node_is_adopted_on_every_lane_and_serves_each(noded, heads):
    head = heads()
    node = noded("join", head.addr, "--engine", "mock", "--max-batch", "2", ready=JOIN_LINE)
    lanes = head.wait_heads(2)
    assert {lane.node.node_identity for lane in lanes} == {node_identity(node)}
    assert all(lane.node.capacity.max_lanes == 2 for lane in lanes)
    serve_one_generation_on_each(lanes, 1)
    node.wait_line(rf"^superfluid-noded: joined the head at 127\.0\.0\.1:{head.port}$")
    assert node.stop() == 0
    assert node.lines[-1] == "superfluid-noded: drained; exiting"


def node_identity(node) -> str:
    return re.search(r"node '(.*)' serves", next(line for line in node.lines if JOIN_LINE.match(line))).group(1)


def test_a_token_encrypts_the_joined_links_and_is_kept_for_the_owner_only(noded, heads, tmp_path):
    head = heads(auth=b"fleet-s3cret")
    node = noded("join", head.addr, "--engine", "mock", "--max-batch", "2", "--token", " fleet-s3cret\n", ready=JOIN_LINE)
    stored = tmp_path / ".superfluid" / "fleet" / "token"
    assert f"superfluid-noded: fleet token stored at {stored}" in node.lines
    assert stored.read_bytes() == b"fleet-s3cret"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    lanes = head.wait_heads(2)
    assert all(lane.dial.noise for lane in lanes)
    serve_one_generation_on_each(lanes, 10)
    assert node.stop() == 0
    # The next start finds the stored token without --token.
    again = heads(auth=b"fleet-s3cret")
    node = noded("join", again.addr, "--engine", "mock", "--max-batch", "1", ready=JOIN_LINE)
    assert f"superfluid-noded: fleet token from {stored}" in node.lines
    serve_one_generation_on_each(again.wait_heads(1), 20)


def test_the_node_redials_a_restarted_head_after_the_back_off(noded, heads):
    head = heads()
    node = noded("join", head.addr, "--engine", "mock", "--max-batch", "2", ready=JOIN_LINE)
    serve_one_generation_on_each(head.wait_heads(2), 1)
    head.close()
    gone = time.monotonic()
    node.wait_line(r"^superfluid-noded: dialing again in 2 s$")
    restarted = heads(port=head.port)
    lanes = restarted.wait_heads(2)
    waited = min(restarted.accepted_at) - gone
    assert 1.9 <= waited < 6, f"redialled {waited:.2f} s after the head went"
    serve_one_generation_on_each(lanes, 30)
    assert node.proc.poll() is None


def test_a_head_that_is_not_up_yet_is_dialled_with_a_growing_back_off(noded):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    node = noded("join", f"127.0.0.1:{port}", "--engine", "mock", "--max-batch", "1", ready=JOIN_LINE)
    node.wait_line(rf"^superfluid-noded: cannot join the head at 127\.0\.0\.1:{port}: ")
    node.wait_line(r"^superfluid-noded: dialing again in 2 s$")
    node.wait_line(r"^superfluid-noded: dialing again in 4 s$", timeout=5)
    assert node.stop() == 0


def test_a_head_that_refuses_the_token_ends_the_node_with_exit_2(noded, heads):
    head = heads(auth=b"the-right-token")
    node = noded("join", head.addr, "--engine", "mock", "--max-batch", "2", "--token", "a-wrong-token", ready=JOIN_LINE)
    assert node.wait(timeout=10) == 2
    assert node.lines[-1] == f"superfluid-noded: {REFUSED}"


def test_joining_a_head_off_loopback_needs_a_token(noded):
    node = noded("join", "192.0.2.1:8454", "--engine", "mock", ready=None)
    assert node.wait() == 2
    assert node.lines == [
        "superfluid-noded: no fleet token: run `superfluid fleet token` on the head and pass "
        "--token <value> here (a head on loopback needs none)"
    ]


def test_insecure_no_auth_joins_without_a_token_and_says_so(noded):
    node = noded("join", "192.0.2.1:8454", "--engine", "mock", "--insecure-no-auth", ready=JOIN_LINE)
    assert (
        "superfluid-noded: WARNING --insecure-no-auth: joining 192.0.2.1:8454 with no fleet token "
        "(transport-only trust)"
    ) in node.lines
    assert node.stop() == 0


def test_the_back_off_doubles_to_30_s_and_starts_over_after_a_join():
    backoff = Backoff()
    assert [backoff.next() for _ in range(7)] == [2, 4, 8, 16, 30, 30, 30]
    backoff.reset()
    assert backoff.next() == 2
