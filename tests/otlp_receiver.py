"""A real OTLP/HTTP receiver for the tests: what an OpenTelemetry Collector's ``otlphttp`` receiver does, in a thread.

It serves ``POST /v1/traces`` and ``POST /v1/metrics`` on a free port, decodes each body (protobuf, gzip when the
exporter compresses) with ``opentelemetry-proto``'s own messages, and keeps what it decoded: spans as ``Span``
records (hex ids, attributes as Python values, events, links, the service that sent it) and metric data points'
names. An exporter pointed at ``url`` (``OTEL_EXPORTER_OTLP_ENDPOINT``) sends to it as it would to a collector.

``Blackhole`` is a collector that is down in the worst way: it accepts connections and never answers.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from broker.redis.server import free_port


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # '' for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 1 internal, 2 server, 3 client
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    service: str
    status: int  # 0 unset, 1 ok, 2 error
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)  # (name, time ns, attributes)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-01"


class _Server(ThreadingHTTPServer):
    # Every test process exports traces and metrics a few times a second: with the default backlog (5), a busy
    # machine's slow accept drops connections, and the exporters' retries come seconds later.
    request_queue_size = 128


class OtlpReceiver:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.spans: list[Span] = []
        self.metrics: list[tuple[str, str, dict[str, Any]]] = []  # (service, metric name, point attributes)
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    receiver._traces(body)
                    reply = ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    receiver._metrics(body)
                    reply = ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = _Server(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def _traces(self, body: bytes) -> None:
        req = ExportTraceServiceRequest.FromString(body)
        out = []
        for rs in req.resource_spans:
            service = str(_attributes(rs.resource.attributes).get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(Span(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), int(s.kind),
                        s.start_time_unix_nano, s.end_time_unix_nano, _attributes(s.attributes), service,
                        int(s.status.code), [(e.name, e.time_unix_nano, _attributes(e.attributes)) for e in s.events],
                        [(link.trace_id.hex(), link.span_id.hex()) for link in s.links]))
        with self._lock:
            self.requests += 1
            self.spans.extend(out)

    def _metrics(self, body: bytes) -> None:
        req = ExportMetricsServiceRequest.FromString(body)
        out: list[tuple[str, str, dict[str, Any]]] = []
        for rm in req.resource_metrics:
            service = str(_attributes(rm.resource.attributes).get("service.name", ""))
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    points = getattr(m, kind).data_points if kind else []
                    out.extend((service, m.name, _attributes(p.attributes)) for p in points)
        with self._lock:
            self.requests += 1
            self.metrics.extend(out)

    # -- use --------------------------------------------------------------------------------------------------

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def where(self, test: Callable[[Span], bool]) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if test(s)]

    def wait_spans(self, test: Callable[[Span], bool], n: int = 1, timeout_s: float = 60.0) -> list[Span]:
        """Until ``n`` spans passing ``test`` arrived (the exporters send every OTEL_BSP_SCHEDULE_DELAY)."""
        deadline = time.monotonic() + timeout_s
        while len(found := self.where(test)) < n:
            assert time.monotonic() < deadline, (
                f"{len(found)} of {n} spans arrived; all: {[(s.service, s.name) for s in self.spans]}")
            time.sleep(0.02)
        return found

    def trace(self, trace_id: str) -> list[Span]:
        return self.where(lambda s: s.trace_id == trace_id)

    def metric_names(self, service: str = "") -> set[str]:
        with self._lock:
            return {name for svc, name, _ in self.metrics if not service or svc == service}


def attribute(s: Span, key: str) -> Any:
    return s.attributes.get(key)


class Blackhole:
    """A port that accepts connections and never answers: a collector hung, or a firewall that drops replies."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="otlp-blackhole", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._held.append(conn)  # held open, never read from nor answered

    @property
    def connections(self) -> int:
        return len(self._held)

    def close(self) -> None:
        self._sock.close()
        for c in self._held:
            c.close()


