"""The rows of `make reliability`: each runs one `superfluid-noded` process under one kind of
load or fault and measures what the table shows. Every row's size is a parameter: the full
sizes are in `run.py`, the short ones in `tests/e2e/test_reliability_short.py`. Traffic goes to
127.0.0.1 only.
"""

from __future__ import annotations

import random
import signal
import socket
import threading
import time

from engine_faults import die, hang, oom, raise_
from harness import Measured, Row, WatchedNode, warm_up
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from soak import soak_mock, soak_torch, soak_torch_int4
from strategies import structs

from conformance.head import FleetHead, Generation
from conformance.raw import RawLink, hung_up, raw_connect, raw_frame
from conformance.reference import mock_tokens
from linkf.budget import DEFAULT_BUDGET
from linkf.errors import LinkFError
from linkf.secure import NoiseRole, SecureStream, key_from
from proto import finish
from proto import postcard
from proto.envelope import MAX_FRAME
from proto.handshake import MAX_HELLO_FRAME, Hello, LinkRole
from proto.linkf import PAYLOAD_TYPES, Lease, msg_type

MOCK = ("--listen", "127.0.0.1:0", "--engine", "mock")
TOKEN = b"reliability-token"
SHORT_LEASE = Lease(duration_ms=1000, renew_by_ms=300)


def _started(*args: str, token: bytes = b"") -> WatchedNode:
    node = WatchedNode(*MOCK, *args, token=token)
    warm_up(node)
    return node


def _check_generation(row: Row, g: Generation, prompt: list[int], max_new: int, reason: int | None = None) -> None:
    """Counts what an ended generation lost or duplicated against the mock's tokens: all
    `max_new` of them for a LENGTH finish, a prefix for any other."""
    if g.tokens != mock_tokens(prompt, len(g.tokens)) or (reason == finish.LENGTH and len(g.tokens) != max_new):
        row.lost += 1
        row.note("tokens differ from the mock's")
    seqs = [e.event_seq for e in g.events]
    if reason is not None and g.finish != reason:
        row.wrong += 1
        row.note(f"finish {g.finish}, wanted {reason}")
    row.duplicated += max(len(seqs) - len(set(seqs)), 0)


# ---- random cuts with reconcile ---------------------------------------------------------------


def cuts(trials: int) -> Row:
    """Each trial cuts the link at a random point of a generation, after losing (not acking) a
    random tail of its events; the head reconnects and reconciles. Every event it had seen must
    be committed after the reconcile, exactly once and in order, the committed tokens must be
    the mock's, and the session must then generate on exactly."""
    row = Row("cuts + reconcile", f"{trials} cuts", trials)
    node = _started("--token-delay-ms", "1")
    rng = random.Random(9)
    try:
        with Measured(row, node), FleetHead.connect(node.addr) as head:
            for t in range(trials):
                _cut_trial(row, head, 100 + t, rng)
    finally:
        node.close()
    return row


def _cut_trial(row: Row, head: FleetHead, sid: int, rng: random.Random) -> None:
    prompt = [rng.randrange(32000) for _ in range(rng.randint(1, 20))]
    epoch = head.assign(sid)
    head.append(sid, prompt)
    req = head.request(sid, rng.randint(8, 48))
    key = (sid, req.generation_id)
    head.idle(rng.uniform(0, 0.03))
    head.lose_events = True
    head.idle(rng.uniform(0, 0.03))
    seen = {e.event_seq for e in head.generations.get(key, Generation(*key)).events}
    head.lose_events = False
    ack = head.reconnect()
    if not all(s.held for s in ack.sessions if s.session_id == sid):
        # Cut before the node had read the ASSIGN: place it anew, as the Rust head does.
        head.assign(sid)
        head.append(sid, prompt)
    committed = head.wal.generation_events(sid, epoch, req.generation_id)
    seqs = [e.event_seq for e in committed]
    row.duplicated += len(seqs) - len(set(seqs))
    lost = len(seen - set(seqs)) + (sorted(set(seqs)) != list(range(len(set(seqs)))))
    tokens = [tok for e in committed if hasattr(e.payload, "tokens") for tok in e.payload.tokens]
    if tokens != mock_tokens(prompt, len(tokens)):
        lost += 1
    if lost:
        row.note(f"session {sid}: {lost} events lost")
    row.lost += lost
    again = head.generate(sid, 8)
    _check_generation(row, again, prompt, 8, finish.LENGTH)
    head.revoke(sid)


# ---- live fuzzing -----------------------------------------------------------------------------

_TYPES = sorted(PAYLOAD_TYPES)
#: Well-formed messages of every type, payloads of random bytes, and envelopes broken on purpose.
FRAMES = st.one_of(
    st.sampled_from(_TYPES).flatmap(lambda t: structs(PAYLOAD_TYPES[t]).map(lambda m: raw_frame(t, postcard.to_bytes(m)))),
    st.builds(raw_frame, st.sampled_from(_TYPES + [0x0FFF, 0x8FFF]), st.binary(max_size=64)),
    st.builds(
        raw_frame,
        st.integers(0, 0xFFFF),
        st.binary(max_size=32),
        version=st.integers(0, 0xFFFF),
        class_byte=st.integers(0, 0xFF),
        length=st.none() | st.integers(0, 2**32 - 1),
    ),
)


def fuzz(frames: int) -> Row:
    """Connections that say HELLO (or not) and then send hypothesis-made frames, while a
    well-behaved head generates on another connection and must get the mock's tokens every time."""
    row = Row("live fuzz (hypothesis)", f"{frames} frames", 0)
    node = _started()
    try:
        with Measured(row, node), _GoodHead(row, node) as good:
            sent = [0, 0]  # frames, connections

            @settings(max_examples=max(frames // 8, 10), deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(st.booleans(), st.lists(FRAMES, min_size=1, max_size=16))
            def one_connection(hello: bool, batch: list[bytes]) -> None:
                _fuzz_connection(node.addr, hello, batch)
                sent[0] += len(batch)
                sent[1] += 1

            while sent[0] < frames:
                one_connection()
            row.faults = sent[0]
            row.load = f"{sent[0]} frames, {sent[1]} conns, {good.generations} good gens"
    finally:
        node.close()
    return row


def _fuzz_connection(addr: str, hello: bool, batch: list[bytes]) -> None:
    try:
        link = RawLink.connect(addr)
        with link.sock:
            if hello:
                link.hello(b"")
            for data in batch:
                link.send(data)
            link.hung_up(0.005)
    except (OSError, LinkFError):
        pass  # the node hung up on it, which is its right


class _GoodHead:
    """A head generating on its own connection for as long as the row's load runs, on a session
    id the fuzzer's well-formed frames are unlikely to name (any link that says HELLO is a head
    on a node without a token, and may place or revoke any session)."""

    SESSION = 0x5EED_1234_5678

    def __init__(self, row: Row, node: WatchedNode) -> None:
        self.row, self.node = row, node
        self.generations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _GoodHead:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        rng = random.Random(1)
        try:
            with FleetHead.connect(self.node.addr, auth=self.node.token) as head:
                head.assign(self.SESSION)
                while not self._stop.is_set():
                    prompt = [rng.randrange(32000) for _ in range(rng.randint(1, 30))]
                    head.append(self.SESSION, prompt)
                    g = head.generate(self.SESSION, 16, timeout=20)
                    _check_generation(self.row, g, prompt, 16, finish.LENGTH)
                    self.generations += 1
        except Exception as e:  # noqa: BLE001 - the table says what the well-behaved head lost
            self.row.lost += 1
            self.row.note(f"the good head: {type(e).__name__}: {e}")


# ---- slow and silent peers --------------------------------------------------------------------


def slow_peers(peers: int) -> Row:
    """A keyed node with `peers` connections that say nothing, dribble a handshake a byte at a
    time, or finish Noise and never say HELLO; a real head must get in within 1 s throughout
    and be served exactly, and every thread and byte must come back once they are gone."""
    row = Row("slow + silent peers", f"{peers} peers", peers)
    node = _started(token=TOKEN)
    socks: list[socket.socket] = []
    stop = threading.Event()
    try:
        with Measured(row, node):
            for i in range(peers):
                socks.append(_slow_peer(node.addr, i % 3))
            dribbler = threading.Thread(target=_dribble, args=(socks[1::3], stop), daemon=True)
            dribbler.start()
            for _ in range(5):
                _head_gets_in(row, node, 1.0)
                time.sleep(0.3)
            stop.set()
            dribbler.join(5)
            for s in socks:
                s.close()
    finally:
        node.close()
    return row


def _slow_peer(addr: str, kind: int) -> socket.socket:
    """0: silent; 1: dribbles its handshake; 2: past Noise, then silent."""
    if kind == 2:
        try:
            return RawLink.connect(addr, TOKEN).sock
        except (OSError, LinkFError):
            pass  # let go for a newer one mid-handshake: fine
    return raw_connect(addr)


def _dribble(socks: list[socket.socket], stop: threading.Event) -> None:
    while not stop.is_set():
        for s in socks:
            try:
                s.send(b"\x00")
            except OSError:
                pass
        stop.wait(0.2)


def _head_gets_in(row: Row, node: WatchedNode, within: float) -> None:
    start = time.monotonic()
    try:
        with FleetHead.connect(node.addr, auth=node.token, timeout=within) as head:
            took = time.monotonic() - start
            head.assign(1)
            head.append(1, [9, 8, 7])
            _check_generation(row, head.generate(1, 8), [9, 8, 7], 8, finish.LENGTH)
    except (OSError, LinkFError) as e:
        row.wrong += 1
        row.note(f"a real head was kept out: {e}")
        return
    if took > within:
        row.wrong += 1
        row.note(f"a real head took {took:.2f} s to get in")


# ---- auth probes ------------------------------------------------------------------------------


def auth(probes: int) -> Row:
    """Wrong token, no token, a replayed handshake, plaintext to a keyed node: each refused,
    the node serving a real head between them."""
    row = Row("auth probes", f"{probes} probes", probes)
    node = _started(token=TOKEN)
    replay = _recorded_handshake(node.addr)
    kinds = (_wrong_token, _no_token, lambda addr: _replayed(addr, replay), _plaintext)
    try:
        with Measured(row, node):
            for i in range(probes):
                if not kinds[i % len(kinds)](node.addr):
                    row.wrong += 1
                    row.note(f"probe {i % len(kinds)} was let in")
                if i % 20 == 0:
                    _head_gets_in(row, node, 2.0)
    finally:
        node.close()
    return row


#: How long a probe waits to be served: a node that served it would answer HELLO within
#: milliseconds; a refused one is dropped at once or left waiting for Noise bytes that never come.
PROBE_WAIT_S = 0.5


def _wrong_token(addr: str) -> bool:
    try:
        FleetHead.connect(addr, auth=b"not-the-token", timeout=PROBE_WAIT_S).close()
    except LinkFError:
        return True
    return False


def _no_token(addr: str) -> bool:
    try:
        FleetHead.connect(addr, timeout=PROBE_WAIT_S).close()
    except LinkFError:
        return True
    return False


def _plaintext(addr: str) -> bool:
    hello = Hello(proto_versions=(2, 3), link_role=LinkRole.HeadDaemon, auth=TOKEN)
    with raw_connect(addr) as sock:
        sock.sendall(raw_frame(msg_type.HELLO, postcard.to_bytes(hello)))
        return _refused(sock)


def _refused(sock: socket.socket) -> bool:
    """Whether the node sends no plaintext HELLO_ACK_F within `PROBE_WAIT_S` (it may send its
    Noise answer, then hang up)."""
    got = bytearray()
    deadline = time.monotonic() + PROBE_WAIT_S
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            data = sock.recv(65536)
        except (TimeoutError, ConnectionError):
            break
        if not data:
            break
        got += data
    return got[6:8] != msg_type.HELLO_ACK_F.to_bytes(2, "little")


class _Recording:
    """A socket whose writes are kept, to be replayed on another connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent = bytearray()

    def sendall(self, data: bytes) -> None:
        self.sent += data
        self.sock.sendall(data)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def _recorded_handshake(addr: str) -> bytes:
    """What a real head wrote on a link the node served: its Noise handshake and its HELLO."""
    recording = _Recording(raw_connect(addr))
    stream = SecureStream.handshake(recording, key_from(TOKEN), NoiseRole.Initiator, 5.0)
    hello = Hello(proto_versions=(2, 3), link_role=LinkRole.HeadDaemon, auth=TOKEN)
    recording.sendall(stream.seal(raw_frame(msg_type.HELLO, postcard.to_bytes(hello))))
    assert recording.sock.recv(65536), "the node did not answer the recorded HELLO"
    recording.sock.close()
    return bytes(recording.sent)


def _replayed(addr: str, replay: bytes) -> bool:
    with raw_connect(addr) as sock:
        sock.sendall(replay)
        return _refused(sock)


# ---- lease expiry -----------------------------------------------------------------------------


def leases(sessions: int) -> Row:
    """`sessions` sessions on 1 s leases whose head never renews, and as many whose head does:
    after 1.5 s every unrenewed one is fenced (a generation on it is declined), every
    renewed one serves exactly, and the fenced ones are forgotten after the retention time."""
    row = Row("lease expiry", f"{2 * sessions} sessions", sessions)
    node = _started("--session-retention-ms", "1000")
    try:
        with Measured(row, node), FleetHead.connect(node.addr) as lapsing, FleetHead.connect(node.addr) as renewing:
            lapsing.grant_renewals = False
            for sid in range(sessions):
                lapsing.assign(1000 + sid, lease=SHORT_LEASE)
                renewing.assign(5000 + sid, lease=SHORT_LEASE)
                renewing.append(5000 + sid, [sid])
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                lapsing.pump()
                renewing.pump()
            for sid in range(sessions):
                declined = lapsing.generate(1000 + sid, 4)
                if declined.finish != finish.DECLINED:
                    row.wrong += 1
                    row.note(f"session {1000 + sid} served after its lease ran out")
                _check_generation(row, renewing.generate(5000 + sid, 4), [sid], 4, finish.LENGTH)
    finally:
        node.close()
    return row


# ---- drain ------------------------------------------------------------------------------------


def drain(heads: int) -> Row:
    """SIGTERM with `heads` heads generating: the ones that finish within the drain timeout end
    LENGTH, the ones it stops end ERROR, every token before either is the mock's, exit 0."""
    row = Row("drain", f"{heads} heads", heads)
    node = _started("--token-delay-ms", "5", "--drain-timeout-ms", "500")
    connected = [FleetHead.connect(node.addr) for _ in range(heads)]
    try:
        with Measured(row, node):
            reqs = []
            for i, head in enumerate(connected):
                head.assign(1 + i)
                head.append(1 + i, [i])
                reqs.append(head.request(1 + i, 20 if i % 2 else 100_000))
            for head, req in zip(connected, reqs):
                head.until(lambda h=head, r=req: h.generations.get((r.session_id, r.generation_id)), 5, "tokens")
            row.peak_rss = node.status("VmHWM")
            node.proc.proc.send_signal(signal.SIGTERM)
            for i, (head, req) in enumerate(zip(connected, reqs)):
                try:
                    g = head.collect(req, timeout=10)
                except Exception as e:  # noqa: BLE001 - no Finish: the table counts it lost
                    row.lost += 1
                    row.note(f"head {i}: {type(e).__name__}")
                    continue
                _check_generation(row, g, [i], req.budgets.max_new_tokens, finish.LENGTH if i % 2 else finish.ERROR)
            if node.proc.wait(15) != 0:
                row.crashes += 1
    finally:
        for head in connected:
            head.close()
        node.close()
    return row


# ---- memory bounds ----------------------------------------------------------------------------


def bounds(sessions: int, big_frames: int) -> Row:
    """`sessions` short-lease sessions assigned, half revoked and half left to fence, then
    forgotten after the retention time; `big_frames` links each sending a legal 16 MiB frame
    slowly (the buffered-frame budget refuses those past it); as many sending a 16 MiB frame
    before HELLO (refused at its header). Memory must come back to the baseline."""
    row = Row("memory bounds", f"{sessions} sessions, {2 * big_frames} big frames", sessions + 2 * big_frames)
    node = _started("--session-retention-ms", "1000")
    try:
        with Measured(row, node):
            with FleetHead.connect(node.addr) as head:
                head.grant_renewals = False
                for sid in range(sessions):
                    head.assign(10_000 + sid, lease=Lease(duration_ms=200, renew_by_ms=100))
                    if sid % 2:
                        head.revoke(10_000 + sid)
                head.idle(0.5)
            _slow_big_frames(row, node.addr, big_frames)
            _big_frames_before_hello(row, node.addr, big_frames)
            time.sleep(1.5)  # the retention time, and a sweep
            grown = node.status("VmHWM") - row.baseline_rss
            if grown > 1.5 * DEFAULT_BUDGET:
                row.wrong += 1
                row.note(f"peak {grown >> 20} MB over the baseline, past the {DEFAULT_BUDGET >> 20} MB frame budget")
    finally:
        node.close()
    return row


def _slow_big_frames(row: Row, addr: str, n: int) -> None:
    links = []
    for _ in range(n):  # each past HELLO before the next: pending ones from one source are capped
        links.append(RawLink.connect(addr))
        links[-1].hello(b"")
        links[-1].send(MAX_FRAME.to_bytes(4, "little"))
    chunk = b"\x00" * (1 << 20)
    for _ in range(8):  # 8 MiB each, round the links, so all are incomplete at once
        for link in links:
            try:
                link.send(chunk)
            except OSError:
                pass  # refused: past the budget
        time.sleep(0.02)
    for link in links:
        link.sock.close()


def _big_frames_before_hello(row: Row, addr: str, n: int) -> None:
    for _ in range(n):
        with raw_connect(addr) as sock:
            sock.sendall(MAX_FRAME.to_bytes(4, "little") + b"\x00" * 4096)
            if not hung_up(sock, 1):
                row.wrong += 1
                row.note(f"a frame over {MAX_HELLO_FRAME} bytes before HELLO was not refused")


#: Every row with its full size (the issue's minimums or more, for `make reliability`) and its
#: short one (for `make test`; None where no short run shows anything).
ROWS = [
    (cuts, {"trials": 500}, {"trials": 20}),
    (fuzz, {"frames": 20_000}, {"frames": 600}),
    (slow_peers, {"peers": 300}, {"peers": 60}),
    (auth, {"probes": 100}, {"probes": 8}),
    (leases, {"sessions": 200}, {"sessions": 10}),
    (drain, {"heads": 8}, {"heads": 2}),
    (bounds, {"sessions": 10_000, "big_frames": 40}, {"sessions": 500, "big_frames": 4}),
    (hang, {"heads": 4}, {"heads": 2}),
    (raise_, {"heads": 3}, {"heads": 3}),
    (die, {"heads": 4}, {"heads": 2}),
    (oom, {"heads": 4}, {"heads": 4}),
    (soak_mock, {"seconds": 180}, {"seconds": 10}),
    (soak_torch, {"seconds": 300}, None),
    (soak_torch_int4, {"seconds": 180}, None),
]
