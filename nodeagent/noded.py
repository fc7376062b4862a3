"""The serving half of `superfluid-noded`: the accept loop, one thread per head connection, and
the drain on SIGTERM/SIGINT.

A connection's failure is one log line naming the peer and the reason, and never reaches the
process or another connection: a head that misbehaves costs only its own link. Neither does a
failure to take or start a connection (out of descriptors, threads or memory): one line, a short
pause, and the loop goes on. Who gets a connection is `admission`'s call: at most
`--max-connections` open, and a flood of handshakes that never finish pushes out only its own
kind, never a real head.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from linkf.driver import SUPPORTED_VERSIONS, Endpoint, show_address
from linkf.errors import Closed, LinkFError, Unauthorized
from linkf.secure import NoiseRole
from linkf.transcript import NODE, Recorder
from nodeagent.admission import Admission, Limits
from nodeagent.agent import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_WRITE_TIMEOUT,
    Connection,
    NodeAgent,
)
from nodeagent.daemon import Daemon, DaemonError, EngineHealth
from nodeagent.heap import return_free_memory
from nodeagent.logs import say
from nodeagent.observe import Observers
from nodeagent.outbox import STREAM_INTERVAL_S
from nodeagent.sdnotify import READY, STOPPING, WATCHDOG, notify

log = logging.getLogger("nodeagent.noded")

#: How often the accept loop looks for a stop signal, and a drain at its generations; also its
#: pause after a connection it could not take or start.
POLL_S = 0.1
#: How long a new connection may say nothing at all: a head speaks at once, so a silent socket
#: is let go long before the handshake timeout.
FIRST_BYTE_S = 2.0
#: How often the accept loop fences expired leases and forgets old fenced sessions itself, so
#: that happens with no head connected too.
SWEEP_S = 1.0
#: Connections the kernel may hold for the accept loop: as many as it allows (it caps this at
#: net.core.somaxconn). The Rust std listener asks for 128; this loop starts a thread for each
#: connection and falls further behind a burst, and a full queue drops a SYN, which the client
#: sends again only a second later. Admission still decides, once accepted, who is served.
LISTEN_BACKLOG = socket.SOMAXCONN
#: How long a drain that ran out of time waits for the generations it stopped to send their
#: Finish.
STOP_GRACE_S = 3.0

#: The exit code of a node whose engine failed (its scheduler died): a supervisor restarts it.
ENGINE_FAILED_EXIT = 4

#: Lanes a node runs at once unless told (`--max-batch`).
DEFAULT_LANES = 8
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_SESSION_RETENTION_MS = 300_000


@dataclass(frozen=True)
class NodeConfig:
    """How a node serves, in plain units: what `superfluid-noded`'s flags set (cli.py builds
    one), so that a program can embed a node with no command line."""

    #: The model name heads match on; None: the engine's own.
    model_name: str | None = None
    max_lanes: int = DEFAULT_LANES
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT
    #: How long a head may be silent before its connection is dropped; 0 keeps every one.
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT
    #: How long a streaming generation's tokens may wait for its connection's next send.
    stream_interval_s: float = STREAM_INTERVAL_S
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    session_retention_ms: int = DEFAULT_SESSION_RETENTION_MS
    #: A directory for each connection's transcript; None records nothing.
    record: Path | None = None


#: Told, once a connection is over (its socket closed, its slot free), the peer and None or the
#: error its serve raised: the error itself, where the observers get only a reason to show.
ConnectionEnd = Callable[[str, BaseException | None], None]


class Node:
    """One node process: the agent every connection shares, and the listener feeding it."""

    def __init__(
        self,
        daemon: Daemon,
        config: NodeConfig = NodeConfig(),
        token: bytes = b"",
        identity: str = "node",
        observer: Observers | None = None,
        on_connection_end: ConnectionEnd | None = None,
    ):
        """`token`: the fleet token (empty: plaintext links, checked by nobody)."""
        self.daemon = daemon
        self.observer = observer if observer is not None else Observers()
        self.identity = identity
        self.model_name = config.model_name or daemon.model_name
        self.token = token
        self.handshake_s = config.handshake_timeout_s
        self.drain_s = config.drain_timeout_s
        self.record = config.record
        self._recorded = itertools.count(1)
        self.agent = (
            NodeAgent(daemon, identity, self.model_name)
            .with_max_lanes(config.max_lanes)
            .with_timeouts(self.handshake_s, config.idle_timeout_s)
            .with_write_timeout(config.write_timeout_s)
            .with_stream_interval(config.stream_interval_s)
            .with_auth(token)
            .with_observer(self.observer)
        )
        self.agent.shared.agent.retention_ms = config.session_retention_ms
        self.admission: Admission[socket.socket] = Admission(Limits(max_connections=max(config.max_connections, 1)))
        self.on_connection_end = on_connection_end
        self._signals = 0
        self._stop = threading.Event()
        #: The engine failed while serving: the node stops, and exits ENGINE_FAILED_EXIT.
        self.engine_failed = False
        #: The connections' threads, the finished ones pruned at each accept; `close` joins them.
        self._threads: list[threading.Thread] = []

    def catch_signals(self) -> None:
        """From now on SIGTERM/SIGINT start a drain (a second one cuts it short); call it before
        the serving line, which a supervisor may answer with a signal at once."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def serve_until_signalled(self, listener: socket.socket) -> int:
        """Accepts heads until a signal, then drains; the process's exit code."""
        self.accept_until_stopped(listener)
        listener.close()
        return self.drain()

    def accept_until_stopped(self, listener: socket.socket) -> None:
        """Accepts heads, each served on a thread of its own, until a signal or `stop`."""
        listener.settimeout(POLL_S)
        swept = time.monotonic()
        while not self._stop.is_set():
            try:
                self._accept_one(listener)
            except MemoryError:
                # Out of memory while taking a connection: that one is lost, the node stays.
                say("out of memory while taking a connection; it is closed")
                time.sleep(POLL_S)
            self.watch_engine()
            if time.monotonic() - swept >= SWEEP_S:
                self.agent.fence(self.agent.now_ms())
                return_free_memory()
                swept = time.monotonic()

    def started(self) -> None:
        """The node serves: /ready and systemd hear of it."""
        self.observer.node_state("serving")
        notify(READY)

    def watch_engine(self) -> None:
        """Tells systemd's watchdog the engine makes progress; once it has failed, stops the
        node, whose drain then exits ENGINE_FAILED_EXIT. Call it every `POLL_S` or so."""
        health = self.daemon.health()
        if health == EngineHealth.OK:
            notify(WATCHDOG)
        elif health == EngineHealth.FAILED and not self.engine_failed:
            self.engine_failed = True
            self.stop()
    def stop(self) -> None:
        """Asks the node to stop accepting, as a first SIGTERM does (for a node run in-process)."""
        self._stop.set()

    def close(self, timeout: float) -> list[str]:
        """Hangs up every connection still open and waits up to `timeout` s for their threads
        (after `accept_until_stopped` has returned); the names of the threads still running.
        For a node run inside another program, where no process exit ends them."""
        for sock in self.admission.handles():
            _hang_up(sock)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]

    def stopping(self) -> bool:
        """Whether a signal asked the node to stop."""
        return self._stop.is_set()

    def wait_for_stop(self, seconds: float) -> bool:
        """Waits up to `seconds` for a stop signal; whether one came."""
        return self._stop.wait(seconds)

    def _on_signal(self, signum, _frame) -> None:
        self._signals += 1
        self.stop()

    def _accept_one(self, listener: socket.socket) -> None:
        try:
            sock, addr = listener.accept()
        except TimeoutError:
            return
        except OSError as e:
            # Out of descriptors, or a connection aborted before it was taken: keep serving.
            say(f"accept failed: {e}")
            time.sleep(POLL_S)
            return
        peer = show_address(addr)
        decision = self.admission.admit(addr[0], sock)
        for gone in decision.evicted:
            log.debug(f"let go of a connection from {gone.source} still in its handshake, for a newer one")
            _hang_up(gone.handle)
        if decision.ticket is None:
            log.debug(f"closed a connection from {peer}: {self.admission.limits.max_connections} connections open")
            sock.close()
            return
        log.debug(f"accepted a connection from {peer}")
        self._threads = [t for t in self._threads if t.is_alive()]
        try:
            thread = threading.Thread(
                target=self._serve_connection,
                args=(decision.ticket, self.agent.connection(), sock, peer),
                name=f"node-conn {peer}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        except (RuntimeError, MemoryError) as e:
            # Out of threads or memory (a container's pids or memory limit): this connection
            # goes, the node stays.
            self.admission.release(decision.ticket)
            sock.close()
            say(f"closed the connection from {peer}: cannot start its thread: {e}")
            time.sleep(POLL_S)

    def _serve_connection(self, ticket: int, conn: Connection, sock: socket.socket, peer: str) -> None:
        error: BaseException | None = None
        try:
            error = self._serve_admitted(ticket, conn, sock, peer)
        finally:
            self.admission.release(ticket)
            sock.close()
            if self.on_connection_end is not None:
                self.on_connection_end(peer, error)

    def _serve_admitted(self, ticket: int, conn: Connection, sock: socket.socket, peer: str) -> BaseException | None:
        """Serves the connection; None or the error that ended it."""
        try:
            if not self._speaks(sock):
                log.warning(f"dropped a connection from {peer}: it sent nothing in {FIRST_BYTE_S:g} s")
                self.observer.ended(peer, None)
                return None
            endpoint = self._open(sock)
        except Unauthorized as e:
            self.observer.ended(peer, e)
            say(f"refused {peer}: its fleet token differs")
            return e
        except Exception as e:  # noqa: BLE001 - one line per failed connection, never more
            self.observer.ended(peer, e)
            self._ended(ticket, peer, f"a connection from {peer} failed its setup: {describe(e, peer)}")
            return e
        error: BaseException | None = None
        try:
            with self._recording(endpoint, peer):
                conn.serve(endpoint, on_hello=lambda: self._hello(ticket, peer))
        except Unauthorized as e:
            error = e
            say(f"refused {peer}: its fleet token differs")
        except Closed as e:
            error = e
            log.debug(f"connection from {peer} closed")
        except Exception as e:  # noqa: BLE001 - as above: the process outlives every connection
            error = e
            self._ended(ticket, peer, f"the connection from {peer} ended: {describe(e, peer)}")
            log.debug("the connection's traceback", exc_info=True)
        finally:
            self.observer.ended(peer, error)
        return error

    def _hello(self, ticket: int, peer: str) -> None:
        self.admission.hello(ticket)
        self.observer.connection_opened(peer)

    def _ended(self, ticket: int, peer: str, line: str) -> None:
        """Says `line`, unless admission let the connection go: then that was the cause."""
        if self.admission.release(ticket):
            say(line)
        else:
            log.debug(f"a connection from {peer} was let go in its handshake")

    def _speaks(self, sock: socket.socket) -> bool:
        """Whether the peer sends something (or hangs up) within `FIRST_BYTE_S`; always True
        when the handshake timeout is as short already."""
        if 0 < self.handshake_s <= FIRST_BYTE_S:
            return True
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(int(FIRST_BYTE_S * 1000)))

    @contextlib.contextmanager
    def _recording(self, endpoint: Endpoint, peer: str):
        """With --record, writes the connection's transcript while it is served."""
        if self.record is None:
            yield
            return
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{next(self._recorded):05d}-{peer}"
        header = {"identity": self.identity, "model": self.model_name, "versions": list(SUPPORTED_VERSIONS),
                  "peer": peer, "encrypted": bool(self.token)}
        with Recorder.create(self.record, name, NODE, **header) as recorder:
            endpoint.recorder = recorder
            yield

    def _open(self, sock: socket.socket) -> Endpoint:
        """The link over `sock`: Noise-wrapped and checked against the token when there is one."""
        if not self.token:
            return Endpoint.from_tcp(sock)
        return Endpoint.from_tcp_secure(sock, self.token, NoiseRole.Responder, self.handshake_s)

    def drain(self) -> int:
        """Waits, up to the drain timeout or a second signal, for running generations to finish."""
        self.observer.node_state("draining")
        notify(STOPPING)
        if self.engine_failed:
            return self._exit_failed()
        running = self.agent.running_generations()
        say(f"draining: no new connections; {running} generation(s) running, waiting up to {self.drain_s:g} s")
        deadline = time.monotonic() + self.drain_s
        while running and self._signals < 2 and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)
            running = self.agent.running_generations()
        if running:
            say(f"drain ended with {running} generation(s) still running; stopping them")
            self.agent.stop_generations()
            deadline = time.monotonic() + STOP_GRACE_S
            while self.agent.running_generations() and time.monotonic() < deadline:
                time.sleep(POLL_S / 5)
        self.daemon.close()
        say("drained; exiting")
        return 0

    def _exit_failed(self) -> int:
        """The engine died and has ended every generation with an error: waits up to
        `STOP_GRACE_S` for their Finish to leave, then ENGINE_FAILED_EXIT."""
        running = self.agent.running_generations()
        say(f"the engine failed; no new connections; ending {running} generation(s) with an error")
        deadline = time.monotonic() + STOP_GRACE_S
        while self.agent.running_generations() and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)
        self.daemon.close()
        say(f"exiting {ENGINE_FAILED_EXIT}: the engine failed")
        return ENGINE_FAILED_EXIT


def _hang_up(sock: socket.socket) -> None:
    """Ends a connection another thread is serving: its read wakes and finds the link closed."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def describe(e: BaseException, peer: str) -> str:
    """An error for a line that already names `peer`: Link F and daemon errors say what they
    are (less the peer they name too), any other is named by its type."""
    if isinstance(e, (LinkFError, DaemonError)):
        return str(e).removesuffix(f" (peer {peer})")
    return f"{type(e).__name__}: {e}"

