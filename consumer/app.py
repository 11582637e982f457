"""The Starlette application: state built in the lifespan, routes, and the one error boundary."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

from broker.client import connect, connect_blocking
from broker.settings import ConsumerSettings
from broker.store import Store
from consumer import openai_compat, web
from consumer.auth import ApiKeys
from consumer.errors import HANDLERS
from consumer.hub import LiveHub
from consumer.limits import ConnectionLimiter
from consumer.metrics import Metrics
from consumer.middleware import AuthMiddleware
from consumer.routes import ROUTES

# How often a pod records, per stream it serves, that a reader is connected. Must stay well under the
# generators' --disconnect-grace-s and any --abandon-after-s.
TOUCH_INTERVAL_S = 2.0


async def _touch_readers(store: Store, hub: LiveHub, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        ids = hub.stream_ids()
        with contextlib.suppress(RedisError, OSError):
            for i in range(0, len(ids), 1000):
                await store.touch(ids[i:i + 1000])


def create_app(settings: ConsumerSettings, *, draining: asyncio.Event | None = None) -> Starlette:
    """``draining`` is set by the server on SIGTERM: open SSE responses then end at an event boundary."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        cluster = settings.broker.cluster
        redis = connect(settings.broker.redis_url, max_connections=settings.redis_pool_size, cluster=cluster)
        # Standalone: the hub's one pub/sub connection comes from here. Cluster: the hub opens one per master
        # itself and uses this client only for the slot map.
        blocking = connect_blocking(settings.broker.redis_url, cluster=cluster)
        hub = LiveHub(blocking)
        await hub.start()
        metrics = Metrics()
        metrics.gauge("rsb_connected_readers", lambda: hub.readers, "SSE readers tailing a stream on this pod")
        metrics.gauge("rsb_live_channels", lambda: hub.channels, "streams this pod is subscribed to")
        metrics.gauge("rsb_live_hub_reconnects", lambda: hub.reconnects, "pub/sub reconnects since start")
        metrics.gauge("rsb_live_hub_connections", lambda: hub.connections,
                      "pub/sub connections to Redis (1, or one per master on a cluster)")
        app.state.settings = settings
        app.state.store = Store(redis, settings.broker.partitions)
        app.state.hub = hub
        app.state.metrics = metrics
        app.state.default_model = settings.default_model
        app.state.draining = draining or asyncio.Event()
        # A read stream must never look unread for abandon_after_s: touch well within it.
        interval_s = TOUCH_INTERVAL_S if settings.abandon_after_s <= 0 else min(TOUCH_INTERVAL_S,
                                                                                settings.abandon_after_s / 3)
        toucher = asyncio.create_task(_touch_readers(app.state.store, hub, interval_s), name="touch-readers")
        try:
            yield
        finally:
            app.state.draining.set()
            toucher.cancel()
            await asyncio.gather(toucher, return_exceptions=True)
            await hub.stop()
            await redis.aclose()
            await blocking.aclose()

    api_keys = (ApiKeys.load(settings.api_keys_file, settings.read_token_secret) if settings.api_keys_file
                else ApiKeys.disabled())
    app = Starlette(routes=[*ROUTES, *openai_compat.ROUTES, *web.ROUTES], exception_handlers=HANDLERS,
                    lifespan=lifespan)
    app.state.api_keys = api_keys
    app.state.limiter = ConnectionLimiter(settings.max_streams_per_ip)
    app.add_middleware(AuthMiddleware, keys=api_keys)
    if settings.cors_origins:  # outermost, so preflights and 401s carry the CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type",
                                                                           "Last-Event-ID"],
                           expose_headers=["Retry-After"], max_age=600)
    return app
