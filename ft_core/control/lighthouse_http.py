"""The lighthouse's HTTP side: status page, /status JSON, /metrics, and the dashboard's Kill.

Routes (all on the lighthouse's --http-bind address):
- `GET /`: the status page (ft_core/control/static/dashboard.html, no external assets; it polls /status).
- `GET /status`: JSON picture of the quorum, the members and the live "why no quorum yet" reason.
- `GET /metrics`: Prometheus text from a per-server registry.
- `POST /replica/<replica_id>/kill`: calls that replica's ManagerService.Kill.

With no token set, everything is readable without one. With a token (argument or FT_TOKEN), every
route needs it, as an `Authorization: Bearer <token>` header or a `?token=<token>` query parameter
(open the page as `http://host:port/?token=<token>`; the page then sends it on each request).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ft_core.errors import ConfigError, FTError, RPCError
from ft_core.control.proto import ft_pb2, ft_pb2_grpc
from ft_core.control.rpc import CHANNEL_OPTIONS, call, open_channel, server_ssl_context, token_matches
from ft_core.net import bind_problem, dial_host, format_host_port, normalize_address, split_host_port

logger = logging.getLogger(__name__)

DASHBOARD = Path(__file__).with_name("static") / "dashboard.html"
KILL_TIMEOUT_S = 5.0
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class LighthouseMetrics:
    """Prometheus metrics of one lighthouse, in their own registry (several servers per process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.quorum_latency = Histogram("ftl_lighthouse_quorum_latency_seconds",
                                        "Time from the first waiting join to the quorum being issued",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.quorums_issued = Counter("ftl_lighthouse_quorums_issued", "Quorums issued", registry=r)
        self.heartbeats_expired = Counter("ftl_lighthouse_heartbeats_expired",
                                          "Replicas that went silent past heartbeat_timeout", registry=r)
        self.stream_deaths = Counter("ftl_lighthouse_deaths_detected",
                                     "Replicas declared dead at once because their heartbeat stream broke",
                                     registry=r)
        self.members = Gauge("ftl_lighthouse_members", "Replica groups with a live heartbeat", registry=r)
        self.participants = Gauge("ftl_lighthouse_participants", "Participants of the last quorum", registry=r)
        self.quorum_id = Gauge("ftl_lighthouse_quorum_id", "Id of the last quorum issued", registry=r)

    def track(self, core: Any) -> None:
        """Read the gauges from the core at scrape time."""
        self.members.set_function(lambda: core.counts()[0])
        self.participants.set_function(lambda: core.counts()[1])
        self.quorum_id.set_function(lambda: core.counts()[2])

    def text(self) -> bytes:
        return generate_latest(self.registry)


def kill_replica(core: Any, replica_id: str, token: str | None, timeout_s: float = KILL_TIMEOUT_S) -> tuple[int, dict]:
    """Call ManagerService.Kill on the replica's manager; (HTTP status, JSON body)."""
    address = core.member_address(replica_id)
    if not address:
        return 404, {"error": f"replica {replica_id!r} is unknown or reported no manager address"}
    target = normalize_address(address)
    channel = open_channel(target, CHANNEL_OPTIONS)
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return 502, {"error": f"could not reach the manager of {replica_id} at {target} within {timeout_s} s"}
        stub = ft_pb2_grpc.ManagerServiceStub(channel)
        try:
            call(stub.Kill, ft_pb2.KillRequest(msg="killed from the lighthouse dashboard"), peer=target,
                 name="ManagerService.Kill", timeout=timeout_s, token=token)
        except RPCError as exc:
            if exc.code != "UNAVAILABLE":  # UNAVAILABLE after connecting: it exited before answering
                return 502, {"error": str(exc)}
        except FTError as exc:
            return 504, {"error": str(exc)}
    finally:
        channel.close()
    logger.warning("replica %s killed from the dashboard (manager %s)", replica_id, target,
                   extra={"replica_id": replica_id, "event": "kill"})
    return 200, {"killed": replica_id, "address": target}


class _Handler(BaseHTTPRequestHandler):
    server_version = "ftl-lighthouse"
    server: _Server
    timeout = 30.0  # a connection that sends nothing is closed, so idle clients cannot pin threads

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("http %s: " + format, self.client_address[0], *args)

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, value: Any) -> None:
        self._send(code, json.dumps(value).encode(), "application/json")

    def _authorized(self, query: str) -> bool:
        token = self.server.token
        if not token:
            return True
        if token_matches(token, [("authorization", self.headers.get("Authorization", ""))]):
            return True
        presented = parse_qs(query).get("token", [""])[0]
        return token_matches(token, [("authorization", f"Bearer {presented}")])

    def _deny(self) -> None:
        self._json(401, {"error": "missing or wrong token: send 'Authorization: Bearer <token>' or add "
                                  "?token=<token> (the job's FT_TOKEN)"})

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/favicon.ico":
            self._send(204, b"", "image/x-icon")
            return
        if not self._authorized(url.query):
            self._deny()
            return
        if url.path == "/status":
            self._json(200, self.server.core.status())
        elif url.path in ("/", "/index.html"):
            self._send(200, self.server.page, "text/html; charset=utf-8")
        elif url.path == "/metrics":
            self._send(200, self.server.metrics.text(), CONTENT_TYPE_LATEST)
        else:
            self._json(404, {"error": f"no route {url.path}; try /, /status or /metrics"})

    do_HEAD = do_GET

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(min(length, 65536))
        if not self._authorized(url.query):
            self._deny()
            return
        parts = url.path.strip("/").split("/")
        if len(parts) == 3 and parts[0] == "replica" and parts[2] == "kill" and parts[1]:
            code, body = kill_replica(self.server.core, unquote(parts[1]), self.server.token)
            self._json(code, body)
        else:
            self._json(404, {"error": f"no route POST {url.path}; try /replica/<replica_id>/kill"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def process_request(self, request: Any, client_address: Any) -> None:
        """One named daemon thread per request (the base class's threads are anonymous)."""
        threading.Thread(target=self.process_request_thread, args=(request, client_address),
                         name="ftl-lighthouse-http-request", daemon=True).start()

    def __init__(self, addr: tuple[str, int], core: Any, metrics: LighthouseMetrics, token: str | None) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.core = core
        self.metrics = metrics
        self.token = token
        self.page = DASHBOARD.read_bytes()
        self.ssl_context = server_ssl_context()  # https when FT_TLS_CERT/FT_TLS_KEY are set
        super().__init__(addr, _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """With TLS, the handshake runs here, in the request's own thread (a slow client blocks no one)."""
        if self.ssl_context is None:
            super().finish_request(request, client_address)
            return
        try:
            request.settimeout(10.0)
            wrapped = self.ssl_context.wrap_socket(request, server_side=True)
        except OSError as exc:  # ssl.SSLError included: a plaintext or broken client
            logger.debug("TLS handshake with %s failed: %s", client_address[0], exc)
            return
        try:
            super().finish_request(wrapped, client_address)
        finally:
            wrapped.close()


class StatusHTTPServer:
    """Serves the routes above from a named thread; `shutdown()` stops it."""

    def __init__(self, bind: str, core: Any, metrics: LighthouseMetrics, token: str | None) -> None:
        host, port = split_host_port(bind, "lighthouse HTTP bind address", hint="port 0 picks a free one")
        try:
            self._server = _Server((host, port), core, metrics, token)
        except OSError as exc:
            raise ConfigError(f"lighthouse HTTP could not bind {bind}: {bind_problem(bind, exc)}") from exc
        scheme = "https" if self._server.ssl_context is not None else "http"
        self._address = f"{scheme}://{format_host_port(dial_host(host), self._server.server_address[1])}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="ftl-lighthouse-http", daemon=True)
        self._thread.start()

    def address(self) -> str:
        return self._address

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
