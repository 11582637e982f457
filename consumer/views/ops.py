"""Operations: liveness, readiness, Prometheus metrics and the OpenAPI document."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from broker.streams.report import COUNTERS, aborted_totals
from consumer.state import state_of
from consumer.views.openapi import build_openapi


async def openapi_route(request: Request) -> Response:
    state = state_of(request)
    return JSONResponse(build_openapi(state.api_keys.enabled, state.settings.request_limits()))


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    await state_of(request).service.ready()
    return JSONResponse({"status": "ready"})


async def metrics_route(request: Request) -> Response:
    state = state_of(request)
    lines = [state.metrics.render()]
    totals = await aborted_totals(state.store.redis, state.settings.broker.partitions)
    for counter in COUNTERS:
        name = f"rsb_aborted_{counter}_total"
        lines.append(f"# HELP {name} aborted generations (cancelled, abandoned, failed): {counter}, by reason")
        lines.append(f"# TYPE {name} counter")
        for (reason, c), value in sorted(totals.items()):
            if c == counter:
                lines.append(f'{name}{{reason="{reason}"}} {value:g}')
    waiting = await state.store.waiting()
    lines.append("# HELP rsb_queue_waiting streams enqueued and not yet claimed by a worker")
    lines.append("# TYPE rsb_queue_waiting gauge")
    lines.append(f"rsb_queue_waiting {waiting}")
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


ROUTES = [
    Route("/openapi.json", openapi_route, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/metrics", metrics_route, methods=["GET"]),
]
