"""`--metrics-listen`: Prometheus text at `/metrics`, liveness at `/health`, readiness at `/ready`.

Names follow the vLLM / SGLang vocabulary (lanes running, generations queued, KV blocks,
prompt and generation tokens, time to first token, inter-token latency) with a
`superfluid_node_` prefix, so dashboards built for those servers read a node with a rename.
What the scheduler already counts (lanes, queues, KV blocks) is read from the engine at scrape
time; what only the serve loop sees (tokens sent, finishes, connections, sessions) is counted
as it happens, through the `NodeObserver` events.

Kubernetes' two questions, apart. `/health` (liveness: should the process be restarted?) is 503
only when the engine makes no progress: a step stalled past its timeout, or a dead scheduler; a
node loading, draining or merely busy is alive. `/ready` (readiness: should work come here?) is
200 only while the node serves with a working engine, so a load balancer stops sending work as
soon as a drain starts.

prometheus-client is the reference exposition library: it gets the text format, escaping and
histogram buckets right, which a hand-rolled writer would have to re-learn.
"""

from __future__ import annotations

import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from nodeagent.daemon import Daemon, EngineHealth
from nodeagent.observe import REFUSAL_REASONS, GenerationWatch, NodeObserver, finish_name

PREFIX = "superfluid_node_"
#: Queue depth labels, in the order of `SchedStats.queue_depth` (node-behaviour.md §2).
QOS_NAMES = ("chat", "completion", "agent", "background")
#: Seconds; vLLM's time-to-first-token buckets cut to what a node sees.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
SERVING = "serving"

# The `_created` series double every counter's lines and no dashboard of vLLM's kind reads them.
disable_created_metrics()


class NodeMetrics(NodeObserver):
    """The node's metrics, in a registry of its own (two nodes in one process stay apart)."""

    def __init__(self, identity: str, version: str) -> None:
        self.identity = identity
        self.version = version
        self.registry = CollectorRegistry()
        self.state = "loading"
        self.daemon: Daemon | None = None
        self.max_lanes = 0
        self._lock = threading.Lock()
        self._held: set[int] = set()
        r = self.registry
        self.info = Gauge(
            PREFIX + "info", "The node: identity, model and version", ["identity", "model", "version"], registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Context tokens of the generations started", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens sent to heads", registry=r)
        self.finished = Counter(PREFIX + "generations_finished", "Generations by finish reason", ["reason"], registry=r)
        self.running = Gauge(PREFIX + "generations_running", "Generations running on some connection", registry=r)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From the GENERATE_REQ to its first token leaving for the head",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between tokens sent after the first (one observation per TOKEN_EVENTS: its gap "
            "divided by its tokens)",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.connections = Gauge(PREFIX + "connections_open", "Head connections past their HELLO", registry=r)
        self.refused = Counter(
            PREFIX + "handshakes_refused",
            "Connections that ended before their HELLO was answered",
            ["reason"],
            registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        self.sessions_held = Gauge(
            PREFIX + "sessions_held", "Sessions placed here and not revoked or fenced", registry=r
        )
        self.sessions_fenced = Counter(PREFIX + "sessions_fenced", "Sessions fenced on lease expiry", registry=r)
        self.stage_forwards = Counter(
            PREFIX + "stage_forwards", "Stage forwards answered, by whether they ran", ["outcome"], registry=r
        )
        r.register(_EngineCollector(self))

    def serve_engine(self, daemon: Daemon, max_lanes: int, model_name: str) -> None:
        """From now on scrapes read the scheduler of `daemon`, serving `model_name`."""
        self.daemon = daemon
        self.max_lanes = max_lanes
        self.info.labels(self.identity, model_name, self.version).set(1)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def engine_health(self) -> EngineHealth:
        return EngineHealth.OK if self.daemon is None else self.daemon.health()

    def liveness(self) -> tuple[bool, str]:
        """`/health`: whether the node makes progress, and what it is doing."""
        engine = self.engine_health()
        return (True, self.state) if engine == EngineHealth.OK else (False, engine.value)

    def readiness(self) -> tuple[bool, str]:
        """`/ready`: whether the node takes work now, or why not."""
        alive, why = self.liveness()
        return (alive and self.state == SERVING), why

    # ---- NodeObserver ------------------------------------------------------------------------

    def node_state(self, state: str) -> None:
        self.state = state

    def connection_opened(self, peer: str) -> None:
        self.connections.inc()

    def connection_closed(self, peer: str, reason: str) -> None:
        self.connections.dec()

    def handshake_refused(self, peer: str, reason: str) -> None:
        self.refused.labels(reason).inc()

    def session_assigned(self, session_id: int, epoch: int) -> None:
        self._hold(session_id, True)

    def session_revoked(self, session_id: int) -> None:
        self._hold(session_id, False)

    def session_fenced(self, session_id: int) -> None:
        self.sessions_fenced.inc()
        self._hold(session_id, False)

    def generation_started(self, session_id: int, generation_id: int, prompt_tokens: int) -> GenerationWatch:
        self.prompt_tokens.inc(prompt_tokens)
        self.running.inc()
        return _Timing(self)

    def generation_declined(self, session_id: int, generation_id: int) -> None:
        self.finished.labels("declined").inc()

    def stage_forwarded(self, ran: bool) -> None:
        self.stage_forwards.labels("ran" if ran else "empty").inc()

    def _hold(self, session_id: int, held: bool) -> None:
        with self._lock:
            if held:
                self._held.add(session_id)
            else:
                self._held.discard(session_id)
            self.sessions_held.set(len(self._held))


class _Timing(GenerationWatch):
    """One generation's clock: its first token against its start, then the gaps between sends."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.metrics = metrics
        self.started = self.last = time.monotonic()
        self.sent = 0
        self.running = True

    def tokens_sent(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        m = self.metrics
        if self.sent == 0:
            m.ttft.observe(now - self.started)
        else:
            m.itl.observe((now - self.last) / count)
        self.sent += count
        self.last = now
        m.generation_tokens.inc(count)

    def finished(self, reason: int) -> None:
        self.metrics.finished.labels(finish_name(reason)).inc()
        self.dropped()

    def dropped(self) -> None:
        if self.running:
            self.running = False
            self.metrics.running.dec()


class _EngineCollector:
    """The scheduler's own figures, read at each scrape."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        daemon = self.metrics.daemon
        if daemon is None:
            return
        stats = daemon.sched_stats()
        yield _gauge("lanes_running", "Lanes decoding now", stats.lanes_active)
        yield _gauge("lanes_max", "Lanes this node runs at once (--max-batch)", self.metrics.max_lanes)
        queued = GaugeMetricFamily(
            PREFIX + "generations_queued", "Generations waiting for a lane, by QoS class", labels=["qos_class"]
        )
        for name, depth in zip(QOS_NAMES, stats.queue_depth, strict=True):
            queued.add_metric([name], depth)
        yield queued
        yield _gauge("kv_blocks_used", "KV pool blocks in use (16 tokens each)", stats.pool_blocks_used)
        yield _gauge("kv_blocks_total", "KV pool blocks in all", stats.pool_blocks_total)
        yield _gauge("context_window_tokens", "The context window", daemon.max_stream_tokens())
        yield _gauge(
            "engine_stalled",
            "1 while an engine step has run past --engine-stall-timeout-ms",
            daemon.health() == EngineHealth.STALLED,
        )
        yield SummaryMetricFamily(
            PREFIX + "decode_step_seconds",
            "Batched decode steps of the engine and the wall time they took",
            count_value=stats.decode_steps,
            sum_value=stats.decode_seconds,
        )
        yield SummaryMetricFamily(
            PREFIX + "decode_forward_seconds",
            "The model's forward in those decode steps: the rest of a step chooses its tokens and hands them on",
            count_value=stats.decode_steps,
            sum_value=stats.decode_forward_seconds,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


class MetricsServer:
    """The HTTP side: `/metrics`, `/health` and `/ready` on threads of their own, apart from Link F."""

    def __init__(self, metrics: NodeMetrics, family: int, sock_addr: tuple) -> None:
        """Binds `sock_addr` (of address `family`) at once: a port in use fails here, before
        the model loads. OSError when it will not bind."""
        self.metrics = metrics
        handler = type("Handler", (_Handler,), {"metrics": metrics})
        server = type("Server", (_Server,), {"address_family": family})
        self.httpd = server(sock_addr, handler)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="node-metrics", daemon=True)

    def address(self) -> tuple:
        return self.httpd.server_address

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:
        """Binds without `HTTPServer`'s reverse DNS lookup of the address, which can stall
        start-up for seconds where no resolver answers."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]


class _Handler(BaseHTTPRequestHandler):
    metrics: NodeMetrics

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._answer(200, CONTENT_TYPE_LATEST, self.metrics.exposition())
        elif path == "/health":
            self._probe(*self.metrics.liveness())
        elif path == "/ready":
            self._probe(*self.metrics.readiness())
        else:
            self._answer(404, "text/plain; charset=utf-8", b"not found: try /metrics, /health or /ready\n")

    def _probe(self, ok: bool, why: str) -> None:
        self._answer(200 if ok else 503, "text/plain; charset=utf-8", f"{why}\n".encode())

    def _answer(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        """Scrapes are not news: nothing in the node's log."""
