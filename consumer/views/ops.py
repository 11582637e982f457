"""Operations: liveness, readiness, Prometheus metrics and the OpenAPI document."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from broker.streams.report import COUNTERS, aborted_totals
from consumer.metrics import CONTENT_TYPE
from consumer.state import State, state_of
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
    return Response(await render_metrics(state_of(request)), media_type=CONTENT_TYPE)


async def render_metrics(state: State) -> bytes:
    """The pod's metrics, and what Redis holds for every pod: /metrics here, or on --metrics-port."""
    # What Redis holds, read for this scrape: the same totals as the aborted-generation report, and the queue.
    totals = await aborted_totals(state.store.redis, state.settings.broker.partitions)
    scraped: list[Metric] = []
    for counter in COUNTERS:
        family = CounterMetricFamily(f"rsb_aborted_{counter}",
                                     f"aborted generations (cancelled, abandoned, failed): {counter}, by reason",
                                     labels=["reason"])
        for (reason, c), value in sorted(totals.items()):
            if c == counter:
                family.add_metric([reason], value)
        scraped.append(family)
    scraped.append(GaugeMetricFamily("rsb_queue_waiting", "streams enqueued and not yet claimed by a worker",
                                     value=await state.store.waiting()))
    backlog = GaugeMetricFamily("rsb_queue_backlog", "jobs waiting in a model's queue, by service tier",
                                labels=["model", "tier"])
    running = GaugeMetricFamily("rsb_queue_running", "jobs of a model claimed and not finished", labels=["model"])
    for model in dict.fromkeys(m.root for m in await state.service.served_models()):
        for tier, n in (await state.store.backlog(model)).items():
            backlog.add_metric([model, tier], n)
        running.add_metric([model], await state.store.running(model))
    scraped += [backlog, running]
    pending = await state.outbox.pending() if state.outbox is not None else 0
    scraped.append(GaugeMetricFamily("rsb_webhooks_pending", "webhook events not delivered yet (being tried or "
                                     "waiting for their next try)", value=pending))
    return state.metrics.render(scraped)


ROUTES = [
    Route("/openapi.json", openapi_route, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/metrics", metrics_route, methods=["GET"]),
]
