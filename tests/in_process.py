"""A consumer pod's stream service in this process, on a real Redis: its own clients, its own live hub, no HTTP.
What the fast tests of late joiners and of sending again (tests/consumer/test_snapshots.py, test_on_busy.py) drive,
one per pod they play."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from broker.redis.connection import connect, connect_blocking
from broker.streams.stream_store import StreamStore
from consumer.edge.auth import ApiKeys
from consumer.edge.limits import ConnectionLimiter
from consumer.metrics import Metrics
from consumer.settings import ConsumerSettings
from consumer.streaming.hub import LiveHub
from consumer.streaming.service import StreamService


@contextlib.asynccontextmanager
async def stream_service(redis_url: str, **settings: Any) -> AsyncIterator[StreamService]:
    """A pod's StreamService (``settings``: its ConsumerSettings' fields), closed at the end."""
    r = connect(redis_url)
    blocking = connect_blocking(redis_url)
    hub = LiveHub(blocking)
    await hub.start()
    try:
        yield StreamService(ConsumerSettings(**settings), StreamStore(r), hub, Metrics(), ApiKeys.disabled(),
                            ConnectionLimiter(0))
    finally:
        await hub.stop()
        await r.aclose()
        await blocking.aclose()
