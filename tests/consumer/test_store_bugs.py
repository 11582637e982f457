"""A bug in what Redis holds (here a WRONGTYPE key planted in a real redis-server) is not Redis being away:
the reader does not keep its client with heartbeats, nor end the body as if the client could resume from
there. Its response is cut (the client sees an error) and the consumer logs why
(broker.redis.connection maps redis-py's errors once: StoreUnavailable for away, a plain StoreError for a bug)."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
import redis
from helpers import create, eventually, read_sse
from servers import StackFactory

from broker.redis.server import RedisServer
from broker.streams.keys import StreamKeys

pytestmark = pytest.mark.slow


def test_a_stream_whose_events_key_holds_another_type_cuts_the_reader_and_says_why(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    proc, _ = s.consumer("--heartbeat-s", "1")  # no generator: the stream stays queued
    with s.client() as c:
        sid = create(c, max_tokens=8).json()["id"]
        events = StreamKeys.of(uuid.UUID(sid), 1).events
        redis_client.delete(events)
        redis_client.set(events, b"not a stream")
        t0 = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError):  # an incomplete body: not a clean end to resume from
            read_sse(c, f"/v1/streams/{sid}/events", timeout_s=10)
        assert time.monotonic() - t0 < 5
    eventually(lambda: "a response's stream failed" in proc.output(), 10, "the failure logged")
    assert "WRONGTYPE" in proc.output()
