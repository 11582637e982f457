"""The Starlette application: the typed state built in the lifespan, the routes of every view, the
authentication middleware and the one error boundary; in front of it, the readers' route (consumer.edge.front)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from broker import telemetry
from broker.durable.store import DurableStore
from broker.redis.connection import connect, connect_blocking
from broker.scrape import serve_scrapes
from broker.storage import one_round
from broker.streams.budget import Teams
from broker.streams.outbox import Outbox
from broker.streams.read_token_secret import shared_read_token_secret
from broker.streams.stream_store import StreamStore
from broker.streams.token_counts import MAX_ASKING, TokenCounts
from broker.streams.usage import Prices
from consumer.edge.auth import ApiKeys
from consumer.edge.errors import HANDLERS, OUT_OF_MEMORY, ShutdownBoundary
from consumer.edge.front import FrontDoor
from consumer.edge.hosts import HostCheck, allowed_names
from consumer.edge.limits import ConnectionLimiter, RefusalBudget
from consumer.edge.middleware import AuthMiddleware, RefusalLimit
from consumer.edge.tracing import TracingMiddleware
from consumer.metrics import Metrics
from consumer.settings import ConsumerSettings
from consumer.state import STATE_KEY, State
from consumer.streaming.conversations import ConversationService
from consumer.streaming.hub import LiveHub
from consumer.streaming.service import StreamService
from consumer.streaming.sse import Drain
from consumer.streaming.webhooks import Deliverer, signing
from consumer.views import ROUTES
from consumer.views.anthropic import REQUEST_HEADERS as ANTHROPIC_HEADERS
from consumer.views.durable import protocol as durable_protocol
from consumer.views.native import stream_events
from consumer.views.ops import render_metrics

log = logging.getLogger("rsb.consumer")

# How often a pod records, per stream it serves, that a reader is connected. Must stay well under the
# generators' --disconnect-grace-s and any --abandon-after-s.
TOUCH_INTERVAL_S = 2.0


async def _touch_readers(store: StreamStore, hub: LiveHub, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        ids = hub.stream_ids()
        with one_round(log, "touching the streams being read", OUT_OF_MEMORY):  # the next round touches them
            for i in range(0, len(ids), 1000):
                await store.touch(ids[i:i + 1000])


# How long the start waits for Redis's maxmemory (the default storage quota) before going on without it.
MAXMEMORY_READ_S = 3.0

# How long a create or cancel waits for a replica (durability replicated) before answering 503.
REPLICA_PATIENCE_S = 5.0


def create_app(settings: ConsumerSettings, *, draining: Drain | None = None, expect_model: bool = False) -> ASGIApp:
    """``draining`` is set by the server on SIGTERM: open SSE responses then end at an event boundary.
    ``expect_model``: the pod's stack starts its own generators (``rsb up``): ready once one serves a model."""
    # Loaded here, not in the lifespan: a broken keys file must stop the start, with its message.
    api_keys = (ApiKeys.load(settings.api_keys_file, settings.read_token_secret) if settings.api_keys_file
                else ApiKeys.disabled())
    limiter = ConnectionLimiter(settings.max_streams_per_ip)
    prices = Prices.load(settings.prices_file) if settings.prices_file else None  # a broken file stops the start
    teams = Teams.load(settings.teams_file) if settings.teams_file else None
    api_keys.check_budgets(teams, prices is not None)
    # Webhook destinations and their secrets, checked before serving (WebhookRefused: one line, said by rsb.cli).
    hook_signing = signing(settings.webhook_url, settings.webhook_secret, api_keys,
                           allow_private=settings.webhook_allow_private)
    drain = draining or Drain()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, State]]:
        b = settings.broker
        redis = connect(b.url, max_connections=settings.redis_pool_size, cluster=b.cluster)
        # Standalone: the hub's one pub/sub connection comes from here. Cluster: the hub opens one per master
        # itself and uses this client only for the slot map.
        blocking = connect_blocking(b.url, cluster=b.cluster)
        # Token counts wait for a generator's answer (BLPOP): on connections of their own, as many as may wait at
        # once, so a burst of counts never holds the pool every create and read needs.
        counting = connect_blocking(b.url, max_connections=MAX_ASKING, cluster=b.cluster)
        hub = LiveHub(blocking, max_buffered=settings.live_buffer_events)
        await hub.start()
        metrics = Metrics()
        OUT_OF_MEMORY.on_refused = metrics.storage_full.inc  # this process's refusals, whichever route wrote
        metrics.gauge("rsb_connected_readers", lambda: hub.readers, "SSE readers tailing a stream on this pod")
        metrics.gauge("rsb_live_channels", lambda: hub.channels, "streams this pod is subscribed to")
        metrics.gauge("rsb_live_hub_reconnects", lambda: hub.reconnects, "pub/sub reconnects since start")
        metrics.gauge("rsb_live_hub_connections", lambda: hub.connections,
                      "pub/sub connections to Redis (1, or one per master on a cluster)")
        # replicated: a create or cancel that no replica acknowledges in time answers 503 (it is idempotent).
        store = StreamStore(redis, b.partitions, durability_level=b.durability, replica_wait_ms=b.replica_wait_ms,
                      replica_patience_s=REPLICA_PATIENCE_S)
        api_keys.set_clock(store.clock.now)
        if api_keys.enabled and not settings.read_token_secret:
            api_keys.set_secret_source(lambda: shared_read_token_secret(redis), settings.read_token_key_refresh_s)
        service = StreamService(settings, store, hub, metrics, api_keys, limiter, expect_model=expect_model,
                                prices=prices, teams=teams)
        state = State(settings=settings, store=store, hub=hub, metrics=metrics, api_keys=api_keys, limiter=limiter,
                      service=service, conversations=ConversationService(service, service.conversations),
                      durable=DurableStore(redis, b.partitions), draining=drain, prices=prices,
                      outbox=Outbox(redis, b.partitions), token_counts=TokenCounts(counting),
                      reports=RefusalBudget(settings.report_burst, settings.report_rate_per_min / 60))
        # A read stream must never look unread for abandon_after_s: touch well within it.
        interval_s = TOUCH_INTERVAL_S if settings.abandon_after_s <= 0 else min(TOUCH_INTERVAL_S,
                                                                                settings.abandon_after_s / 3)
        toucher = asyncio.create_task(_touch_readers(store, hub, interval_s), name="touch-readers")
        # Before the first create (a small Redis means a small quota); a Redis away at start is read later.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(service.read_storage_default(), MAXMEMORY_READ_S)
        memory = asyncio.create_task(service.follow_maxmemory(), name="follow-maxmemory")
        background = [toucher, memory]
        if hook_signing is not None:
            deliverer = Deliverer(redis, b.partitions, hook_signing, metrics,
                                  allow_private=settings.webhook_allow_private)
            background.append(asyncio.create_task(deliverer.run(), name="webhooks"))
        scrapes = None
        try:
            if settings.scrape_port:  # in the try: a port in use stops the start with everything closed
                scrapes = await serve_scrapes(lambda: render_metrics(state), settings.scrape_host,
                                              settings.scrape_port)
            yield {STATE_KEY: state}
        finally:
            if scrapes is not None:
                scrapes.close()
            drain.set()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await hub.stop()
            await store.aclose()
            await redis.aclose()
            await blocking.aclose()
            await counting.aclose()

    app = Starlette(routes=ROUTES, exception_handlers=HANDLERS, lifespan=lifespan)
    app.add_middleware(AuthMiddleware, keys=api_keys, metrics_token=settings.metrics_token)
    if settings.cors_origins:  # outermost, so preflights and 401s carry the CORS headers too
        # The Durable Streams view (consumer/views/durable) adds its methods and its Stream-*/Producer-* headers;
        # Anthropic's clients send their key as X-Api-Key, with their version headers.
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=list(durable_protocol.METHODS),
                           allow_headers=sorted({"Last-Event-ID", "Idempotency-Key", *durable_protocol.REQUEST_HEADERS,
                                                 *ANTHROPIC_HEADERS}),
                           expose_headers=list(durable_protocol.RESPONSE_HEADERS), max_age=600)
    front: ASGIApp = FrontDoor(app, stream_events, api_keys, cors=bool(settings.cors_origins))
    if not api_keys.enabled:
        # Open API: only the names it is legitimately reached by (DNS rebinding; consumer.edge.hosts).
        front = HostCheck(front, allowed_names(settings.host, settings.allowed_hosts))
    # Before any check or route: an address that keeps sending what is refused waits, whatever it sends.
    front = RefusalLimit(front, RefusalBudget(settings.refusal_burst, settings.refusal_rate_per_s))
    # Past the drain's grace period, a request uvicorn cancels answers 503, not 500.
    bounded: ASGIApp = ShutdownBoundary(front, drain)
    # Outermost, and only with traces exported: each request's server span (consumer.edge.tracing).
    return TracingMiddleware(bounded) if telemetry.TRACER is not None else bounded
