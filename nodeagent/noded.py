"""The serving half of `superfluid-noded`: the accept loop, one thread per head connection, and
the drain on SIGTERM/SIGINT.

A connection's failure is one log line naming the peer and the reason, and never reaches the
process or another connection: a head that misbehaves costs only its own link.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import signal
import socket
import threading
import time
from pathlib import Path

from linkf.driver import SUPPORTED_VERSIONS, Endpoint
from linkf.errors import LinkFError
from linkf.secure import NoiseRole
from linkf.transcript import NODE, Recorder
from nodeagent.agent import NodeAgent
from nodeagent.cli import Options, say, show_addr
from nodeagent.daemon import Daemon, DaemonError

log = logging.getLogger("nodeagent.noded")

#: Handshakes in progress at once; past this a connection is closed before its handshake, so a
#: burst of connects (a port scan) cannot hold a thread each for the handshake timeout.
MAX_HANDSHAKES = 64
#: How often the accept loop looks for a stop signal, and a drain at its generations.
POLL_S = 0.1


class Node:
    """One node process: the agent every connection shares, and the listener feeding it."""

    def __init__(self, daemon: Daemon, opts: Options, token: bytes, identity: str):
        self.daemon = daemon
        self.identity = identity
        self.model_name = opts.model_name or daemon.model_name
        self.token = token
        self.handshake_s = opts.handshake_timeout_ms / 1000
        self.drain_s = opts.drain_timeout_ms / 1000
        self.record = None if opts.record is None else Path(opts.record)
        self._recorded = itertools.count(1)
        self.agent = (
            NodeAgent(daemon, identity, self.model_name)
            .with_max_lanes(opts.max_batch)
            .with_timeouts(self.handshake_s, opts.idle_timeout_ms / 1000)
            .with_auth(token)
        )
        self._handshakes = threading.Semaphore(MAX_HANDSHAKES)
        self._signals = 0
        self._stop = threading.Event()

    def catch_signals(self) -> None:
        """From now on SIGTERM/SIGINT start a drain (a second one cuts it short); call it before
        the serving line, which a supervisor may answer with a signal at once."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def serve_until_signalled(self, listener: socket.socket) -> int:
        """Accepts heads until a signal, then drains; the process's exit code."""
        listener.settimeout(POLL_S)
        while not self._stop.is_set():
            self._accept_one(listener)
        listener.close()
        return self.drain()

    def _on_signal(self, signum, _frame) -> None:
        self._signals += 1
        self._stop.set()

    def _accept_one(self, listener: socket.socket) -> None:
        try:
            sock, addr = listener.accept()
        except socket.timeout:
            return
        except OSError as e:
            # Out of descriptors, or a connection aborted before it was taken: keep serving.
            say(f"accept failed: {e}")
            time.sleep(POLL_S)
            return
        peer = show_addr(addr)
        if not self._handshakes.acquire(blocking=False):
            log.debug(f"closed a connection from {peer}: {MAX_HANDSHAKES} handshakes already in progress")
            sock.close()
            return
        log.debug(f"accepted a connection from {peer}")
        conn = self.agent.connection()
        threading.Thread(
            target=self._serve_connection, args=(conn, sock, peer), name=f"node-conn {peer}", daemon=True
        ).start()

    def _serve_connection(self, conn: NodeAgent, sock: socket.socket, peer: str) -> None:
        try:
            endpoint = self._open(sock)
        except LinkFError.Unauthorized:
            say(f"refused {peer}: its fleet token differs")
            return
        except Exception as e:  # noqa: BLE001 - one line per failed connection, never more
            say(f"a connection from {peer} failed its setup: {describe(e, peer)}")
            sock.close()
            return
        finally:
            self._handshakes.release()
        try:
            with self._recording(endpoint, peer):
                conn.serve(endpoint)
        except LinkFError.Unauthorized:
            say(f"refused {peer}: its fleet token differs")
        except LinkFError.Closed:
            log.debug(f"connection from {peer} closed")
        except Exception as e:  # noqa: BLE001 - as above: the process outlives every connection
            say(f"the connection from {peer} ended: {describe(e, peer)}")
            log.debug("the connection's traceback", exc_info=True)

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
        running = self.agent.running_generations()
        say(f"draining: no new connections; {running} generation(s) running, waiting up to {self.drain_s:g} s")
        deadline = time.monotonic() + self.drain_s
        while running and self._signals < 2 and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)
            running = self.agent.running_generations()
        if running:
            say(f"drain ended with {running} generation(s) still running; stopping them")
        self.daemon.close()
        say("drained; exiting")
        return 0


def describe(e: BaseException, peer: str) -> str:
    """An error for a line that already names `peer`: Link F and daemon errors say what they
    are (less the peer they name too), any other is named by its type."""
    if isinstance(e, (LinkFError, DaemonError)):
        return str(e).removesuffix(f" (peer {peer})")
    return f"{type(e).__name__}: {e}"
