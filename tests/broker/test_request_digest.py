"""A finished or cancelled stream keeps a digest of its request, not the body: enough for the create rule (the same
request again is 200, another one 409), not the prompt held for the whole retention. Real redis-server, real
``rsb consumer`` (and a real generator for the finished case)."""

from __future__ import annotations

import uuid

import redis
from helpers import create, wait_status
from servers import StackFactory

from broker.redis.server import RedisServer
from broker.streams.keys import StreamKeys

PROMPT = "a long prompt " * 2000


def _meta(sid: str) -> str:
    return StreamKeys.of(uuid.UUID(sid), 1).meta


def test_a_cancelled_stream_keeps_only_the_digest(stack_factory: StackFactory, redis_server: RedisServer,
                                                  redis_client: redis.Redis) -> None:
    stack = stack_factory(redis_server.url)
    stack.consumer()  # no generator: the stream stays queued until cancelled
    c = stack.client()
    sid = str(uuid.uuid4())
    assert create(c, id=sid, prompt=PROMPT).status_code == 201
    assert len(redis_client.hget(_meta(sid), "req") or b"") > len(PROMPT)
    assert c.post(f"/v1/streams/{sid}/cancel").json()["status"] == "cancelled"
    assert redis_client.hget(_meta(sid), "req") is None
    assert redis_client.hget(_meta(sid), "rh")
    again = create(c, id=sid, prompt=PROMPT)
    assert again.status_code == 200 and again.json()["status"] == "cancelled" and again.json()["created"] is False
    other = create(c, id=sid, prompt=PROMPT + "!")
    assert other.status_code == 409 and other.json()["error"]["code"] == "conflict"
    assert c.get(f"/v1/streams/{sid}").json()["status"] == "cancelled"


def test_a_finished_stream_keeps_only_the_digest(stack_factory: StackFactory, redis_server: RedisServer,
                                                 redis_client: redis.Redis) -> None:
    stack = stack_factory(redis_server.url)
    stack.generator()
    stack.consumer()
    c = stack.client()
    sid = str(uuid.uuid4())
    assert create(c, id=sid, prompt="Hello", max_tokens=8).status_code == 201
    assert wait_status(c, sid, {"done"})["status"] == "done"
    assert redis_client.hget(_meta(sid), "req") is None
    assert create(c, id=sid, prompt="Hello", max_tokens=8).status_code == 200
    assert create(c, id=sid, prompt="Hello", max_tokens=9).status_code == 409
