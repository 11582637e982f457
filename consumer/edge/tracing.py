"""Each HTTP request's server span (OpenTelemetry's HTTP conventions), continuing the client's W3C ``traceparent``.

Installed outermost, and only when traces are exported (broker.telemetry): with tracing off the app is not wrapped
at all. The span is current while the request runs, so what the request does under it is its child: a create stores
it with the stream (its generation's spans continue it, in the generators), a read's ``fetch_response`` span
(consumer.streaming.service) sits under it. Named ``{method} {route}`` with the route's template, never its path
(stream ids would make every name unique); the query string is not recorded (it may carry a read token).
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker import telemetry

# Probes and scrapes: every few seconds from an orchestrator, nothing a trace would explain.
UNTRACED = frozenset({"/healthz", "/readyz", "/metrics"})
# Where the front door (consumer.edge.front), which serves the readers' route below Starlette's router, says
# which route it served.
ROUTE_KEY = "rsb.route"


def _route(scope: Scope) -> str | None:
    named = scope.get(ROUTE_KEY)
    if named is not None:
        return str(named)
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else None


class TracingMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = telemetry.TRACER
        if scope["type"] != "http" or tracer is None or scope["path"] in UNTRACED:
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind

        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"traceparent", b"tracestate")}
        method = scope["method"]
        attributes: dict[str, Any] = {"http.request.method": method, "url.path": scope["path"],
                                      "url.scheme": scope.get("scheme", "http")}
        client = scope.get("client")
        if client:
            attributes["client.address"] = client[0]
        span = tracer.start_span(method, context=telemetry.context_of(carrier), kind=SpanKind.SERVER,
                                 attributes=attributes)
        status: list[int] = []

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        try:
            with telemetry.current(span):
                await self.app(scope, receive, traced_send)
        except BaseException as e:
            telemetry.mark_error(span, type(e).__qualname__)
            raise
        finally:
            route = _route(scope)
            if route is not None:
                span.set_attribute("http.route", route)
                span.update_name(f"{method} {route}")
            if status and status[0] >= 500:
                telemetry.mark_error(span, str(status[0]))
            span.end()
