"""Per-replica-group Prometheus metrics, fed by the Manager's structured events.

The Manager logs each quorum, heal, commit and error on the logger "ft_core.events" with the
fields in `record.ft_event`; `EventMetrics` is a logging handler that turns them into metrics in
its own registry, labelled by replica id (several Managers may share a process). Routine per-step
events (a quorum that changed nothing, a committed step) are logged at DEBUG only, so they cost no
log record at INFO; the Manager hands them straight to every `EventMetrics` attached to that logger
(`counting_handlers`), so the commit counter, step and quorum latency still see every step.
`serve()` exposes them on `/metrics` of a small HTTP server; `start_from_settings()` does both when
FT_METRICS_PORT is set (the port of this replica group's rank 0; 0 lets the OS choose; `ftl launch`
gives group g PORT+g). Only a group's rank 0 should call it: the other ranks' events are not counted.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ft_core import settings
from ft_core.errors import ConfigError
from ft_core.net import bind_problem, format_host_port, split_host_port

logger = logging.getLogger(__name__)

EVENTS_LOGGER = "ft_core.events"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EventMetrics(logging.Handler):
    """Manager events -> metrics: step, commits, commit failures, heals, heal seconds and bytes,
    participants and quorum latency, per replica id."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(level=logging.INFO)
        self._seen: set[str] = set()
        self.registry = registry if registry is not None else CollectorRegistry()
        r, label = self.registry, ["replica_id"]
        self.step = Gauge("ftl_group_step", "Step of the replica group (committed steps so far)", label, registry=r)
        self.commits = Counter("ftl_group_commits", "Steps committed", label, registry=r)
        self.commit_failures = Counter("ftl_group_commit_failures", "Steps that did not commit", label, registry=r)
        self.errors = Counter("ftl_group_step_errors", "Errors recorded during a step (it will not commit)", label,
                              registry=r)
        self.heals = Counter("ftl_group_heals", "Times this group loaded a live peer's state", label, registry=r)
        self.heal_seconds = Counter("ftl_group_heal_seconds", "Seconds spent fetching and loading healed state",
                                    label, registry=r)
        self.heal_bytes = Counter("ftl_group_heal_bytes", "Bytes of state received by healing", label, registry=r)
        self.participants = Gauge("ftl_group_participants", "Replica groups taking part in the current step",
                                  label, registry=r)
        self.quorum_id = Gauge("ftl_group_quorum_id", "Id of the last quorum this group joined", label, registry=r)
        self.quorum_latency = Histogram("ftl_group_quorum_latency_seconds", "Time the quorum call took", label,
                                        buckets=LATENCY_BUCKETS, registry=r)

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if isinstance(event, Mapping) and not self.count(event):
            self.handleError(record)

    def count(self, event: Mapping[str, Any]) -> bool:
        """Observe one event of a group's rank 0 (others are ignored: the group's numbers, once);
        False when it was malformed (a malformed event must never break the step that made it)."""
        if event.get("group_rank", 0) != 0:
            return True
        try:
            self.observe(event)
        except Exception:  # noqa: BLE001 - reported by the caller (handleError) or dropped
            logger.debug("malformed event not counted: %r", event)
            return False
        return True

    def observe(self, event: Mapping[str, Any]) -> None:
        rid = str(event.get("replica_id", ""))
        kind = event.get("type")
        if rid not in self._seen:  # every series from the first event on, zeros included
            self._seen.add(rid)
            for metric in (self.commits, self.commit_failures, self.errors, self.heals, self.heal_seconds,
                           self.heal_bytes):
                metric.labels(rid)
        if isinstance(event.get("step"), int):
            self.step.labels(rid).set(event["step"])
        if kind == "quorum":
            self.participants.labels(rid).set(float(event.get("num_participants") or 0))
            self.quorum_id.labels(rid).set(float(event.get("quorum_id") or 0))
            self.quorum_latency.labels(rid).observe(float(event.get("seconds") or 0.0))
        elif kind == "commit":
            (self.commits if event.get("committed") else self.commit_failures).labels(rid).inc()
        elif kind == "heal":
            self.heals.labels(rid).inc()
            self.heal_seconds.labels(rid).inc(max(0.0, float(event.get("seconds") or 0.0)))
            self.heal_bytes.labels(rid).inc(max(0, int(event.get("nbytes") or 0)))
        elif kind == "error":
            self.errors.labels(rid).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


def counting_handlers(events: logging.Logger) -> list[EventMetrics]:
    """The EventMetrics attached to `events`: they count routine events, which get no log record at INFO
    (Manager._emit hands those to them directly). Per step this is one look at an often empty list."""
    handlers = events.handlers
    return [h for h in handlers if isinstance(h, EventMetrics)] if handlers else []


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 30.0

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("metrics http %s: " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            body, code, kind = b"try /metrics\n", 404, "text/plain"
        else:
            body, code, kind = self.server.metrics.text(), 200, CONTENT_TYPE_LATEST
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], metrics: EventMetrics) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.metrics = metrics
        super().__init__(addr, _Handler)


class MetricsServer:
    """`/metrics` of an `EventMetrics` on `bind` (host:port), attached to the events logger until `shutdown()`."""

    def __init__(self, bind: str = "127.0.0.1:0", metrics: EventMetrics | None = None) -> None:
        host, port = split_host_port(bind, "metrics bind address (FT_METRICS_PORT)", hint="port 0 picks a free one")
        self.metrics = metrics if metrics is not None else EventMetrics()
        try:
            self._server = _Server((host, port), self.metrics)
        except OSError as exc:
            raise ConfigError(f"metrics server could not bind {bind}: {bind_problem(bind, exc)} "
                              f"(FT_METRICS_PORT, 0 picks a free one)") from exc
        self._address = format_host_port(host, self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="ftl-group-metrics-http", daemon=True)
        self._thread.start()
        events = logging.getLogger(EVENTS_LOGGER)
        events.addHandler(self.metrics)
        self._level, self._propagate = events.level, events.propagate
        if events.getEffectiveLevel() > logging.INFO:
            # The user did not ask for these records: raise them for the metrics only, not for their handlers.
            events.setLevel(logging.INFO)
            events.propagate = False
        logger.info("replica group metrics on http://%s/metrics", self._address)

    def address(self) -> str:
        return self._address

    def url(self) -> str:
        return f"http://{self._address}/metrics"

    def shutdown(self) -> None:
        events = logging.getLogger(EVENTS_LOGGER)
        events.removeHandler(self.metrics)
        if not events.handlers:
            events.setLevel(self._level)
            events.propagate = self._propagate
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


_started: MetricsServer | None = None
_lock = threading.Lock()


def start_from_settings(host: str = "127.0.0.1", environ: Mapping[str, str] | None = None) -> MetricsServer | None:
    """The process's metrics server when FT_METRICS_PORT is set (started once; later calls return it), else None."""
    global _started
    port = settings.value("FT_METRICS_PORT", environ=environ)
    if port is None:
        return None
    with _lock:
        if _started is None:
            _started = MetricsServer(format_host_port(host, int(port)))
        return _started
