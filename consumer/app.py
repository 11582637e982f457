"""The Starlette application: state built in the lifespan, routes, and the one error boundary."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette

from broker.client import connect, connect_blocking
from broker.settings import ConsumerSettings
from broker.store import Store
from consumer.errors import HANDLERS
from consumer.hub import LiveHub
from consumer.metrics import Metrics
from consumer.routes import ROUTES


def create_app(settings: ConsumerSettings, *, draining: asyncio.Event | None = None) -> Starlette:
    """``draining`` is set by the server on SIGTERM: open SSE responses then end at an event boundary."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        redis = connect(settings.broker.redis_url, max_connections=settings.redis_pool_size)
        blocking = connect_blocking(settings.broker.redis_url)
        hub = LiveHub(blocking)
        await hub.start()
        metrics = Metrics()
        metrics.gauge("rsb_connected_readers", lambda: hub.readers, "SSE readers tailing a stream on this pod")
        metrics.gauge("rsb_live_channels", lambda: hub.channels, "streams this pod is subscribed to")
        metrics.gauge("rsb_live_hub_reconnects", lambda: hub.reconnects, "pub/sub reconnects since start")
        app.state.settings = settings
        app.state.store = Store(redis, settings.broker.partitions)
        app.state.hub = hub
        app.state.metrics = metrics
        app.state.default_model = settings.default_model
        app.state.draining = draining or asyncio.Event()
        try:
            yield
        finally:
            app.state.draining.set()
            await hub.stop()
            await redis.aclose()
            await blocking.aclose()

    return Starlette(routes=ROUTES, exception_handlers=HANDLERS, lifespan=lifespan)
