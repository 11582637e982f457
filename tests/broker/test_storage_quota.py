"""The per-caller storage quota against the floods of issue 23: one address fills its quota with Durable Streams
appends and forks (a fork counts at its full size) against a capped Redis, and is refused with 429 storage_quota
and a message naming the bound and the setting, while a second address still creates streams. Deleting and expiry
give the bytes back; a stream's request body counts while it is held. Real redis-server, real ``rsb consumer``
(callers told apart by X-Forwarded-For from a trusted proxy, as behind nginx)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis
from helpers import eventually, metric
from servers import StackFactory

from broker.redis.quota import storage_key
from broker.redis.server import RedisServer
from broker.streams.keys import tenant_of

pytestmark = pytest.mark.slow

QUOTA = 8 * 1024 * 1024
MIB = b"x" * (1024 * 1024 - 1024)  # one append: under --ds-max-body-bytes (1 MiB)
FLOODER, OTHER = "10.1.0.1", "10.2.0.1"


@pytest.fixture
def capped() -> Iterator[tuple[RedisServer, redis.Redis]]:
    server = RedisServer().start()
    client = redis.Redis(port=server.port)
    client.config_set("maxmemory", str(64 * 1024 * 1024))
    client.config_set("maxmemory-policy", "noeviction")
    yield server, client
    client.close()
    server.cleanup()


def _as(c: httpx.Client, address: str) -> dict[str, str]:
    return {"X-Forwarded-For": address}


def _create(c: httpx.Client, headers: dict[str, str], **fields: object) -> httpx.Response:
    body = {"id": str(uuid.uuid4()), "prompt": "Hello", "max_tokens": 4, **fields}
    return c.post("/v1/streams", json=body, headers=headers)


def _held(r: redis.Redis, address: str) -> int:
    return int(r.hget(storage_key(0, 1, tenant_of("", address)), "bytes") or 0)


def test_one_address_fills_its_quota_and_another_still_creates(capped: tuple[RedisServer, redis.Redis],
                                                               stack_factory: StackFactory) -> None:
    server, r = capped
    stack = stack_factory(server.url)
    stack.consumer("--storage-quota-bytes", str(QUOTA), "--forwarded-allow-ips", "127.0.0.1")
    c = stack.client()
    flood = _as(c, FLOODER)

    # Appends: 1 MiB at a time until the quota refuses one.
    assert c.put("/v1/stream/flood", headers={**flood, "Content-Type": "application/octet-stream"}).status_code == 201
    appended = 0
    while True:
        resp = c.post("/v1/stream/flood", content=MIB, headers={**flood, "Content-Type": "application/octet-stream"})
        if resp.status_code != 204:
            break
        appended += 1
        assert appended <= QUOTA // len(MIB), "the quota never refused an append"
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert err["code"] == "storage_quota" and str(QUOTA) in err["message"] and "--storage-quota-bytes" in err["message"]
    assert appended == QUOTA // (len(MIB) + 64)
    assert QUOTA - len(MIB) - 64 < _held(r, FLOODER) <= QUOTA

    # A fork costs its full size: refused while the quota is full; so is a new stream, or a create with a prompt.
    fork = c.put("/v1/stream/fork1", headers={**flood, "Stream-Forked-From": "/v1/stream/flood"})
    assert fork.status_code == 429 and fork.json()["error"]["code"] == "storage_quota", fork.text
    big = c.put("/v1/stream/more", content=MIB, headers={**flood, "Content-Type": "text/plain"})
    assert big.status_code == 429
    assert _create(c, flood, prompt="y" * 100_000).status_code == 429

    # Another address is untouched: it creates streams, Durable and rsb's.
    other = _as(c, OTHER)
    assert _create(c, other).status_code == 201
    assert c.put("/v1/stream/mine", content=MIB, headers={**other, "Content-Type": "text/plain"}).status_code == 201
    assert _held(r, OTHER) > len(MIB)
    assert int(r.info("memory")["used_memory"]) < 64 * 1024 * 1024, "the flood reached Redis's maxmemory"

    # Deleting gives the bytes back; a fork is then charged at its source's full size.
    assert c.delete("/v1/stream/flood", headers=flood).status_code == 204
    assert _held(r, FLOODER) == 0
    assert c.put("/v1/stream/src", content=MIB, headers={**flood, "Content-Type": "text/plain"}).status_code == 201
    for _ in range(2):
        assert c.post("/v1/stream/src", content=MIB, headers={**flood, "Content-Type": "text/plain"}).status_code == 204
    one = _held(r, FLOODER)
    assert c.put("/v1/stream/f1", headers={**flood, "Stream-Forked-From": "/v1/stream/src"}).status_code == 201
    assert _held(r, FLOODER) == 2 * one
    refused = c.put("/v1/stream/f2", headers={**flood, "Stream-Forked-From": "/v1/stream/src"})
    assert refused.status_code == 429, "a third copy of 3 MiB fits no 8 MiB quota"

    # Expiry gives the bytes back too (Redis expires the keys; the next write sweeps them off the count).
    for name in ("src", "f1"):
        assert c.delete(f"/v1/stream/{name}", headers=flood).status_code == 204
    assert _held(r, FLOODER) == 0
    short = {**flood, "Content-Type": "text/plain", "Stream-TTL": "1"}
    assert c.put("/v1/stream/brief", content=MIB, headers=short).status_code == 201
    assert _held(r, FLOODER) > len(MIB)
    eventually(lambda: c.head("/v1/stream/brief", headers=flood).status_code == 404, 10, "the stream expired")
    assert c.put("/v1/stream/next", content=b"hi", headers={**flood, "Content-Type": "text/plain", "Stream-TTL": "60"}
                 ).status_code == 201
    assert _held(r, FLOODER) < 1024
    # The caller's count lives as long as its longest-lived item, then leaves Redis with it.
    key = storage_key(0, 1, tenant_of("", FLOODER))
    assert 59_000 < r.pttl(key) <= 61_000 and 59_000 < r.pttl(key + ":exp") <= 61_000
    # Refused: 1 append, 1 fork, 1 new stream, 1 create; and the third fork.
    assert metric(httpx.get(f"{stack.base_url}/metrics").text, "rsb_storage_quota_rejected_total") == 5


def test_a_streams_request_counts_while_it_is_held(capped: tuple[RedisServer, redis.Redis],
                                                   stack_factory: StackFactory) -> None:
    server, r = capped
    stack = stack_factory(server.url)
    stack.consumer("--storage-quota-bytes", str(QUOTA), "--forwarded-allow-ips", "127.0.0.1")
    c = stack.client()
    who = _as(c, FLOODER)
    sid = str(uuid.uuid4())
    assert _create(c, who, id=sid, prompt="z" * 150_000).status_code == 201  # queued: no generator
    assert 150_000 < _held(r, FLOODER) < 160_000
    assert c.post(f"/v1/streams/{sid}/cancel", headers=who).status_code == 202
    assert _held(r, FLOODER) == 0  # the body went with the cancel; only its digest stays


def test_a_conversations_history_counts_in_its_owners_quota(capped: tuple[RedisServer, redis.Redis],
                                                            stack_factory: StackFactory) -> None:
    server, r = capped
    stack = stack_factory(server.url)
    stack.consumer("--storage-quota-bytes", "400000", "--forwarded-allow-ips", "127.0.0.1")
    c = stack.client()
    who = _as(c, FLOODER)

    def items(n: int) -> list[dict[str, object]]:
        return [{"type": "message", "role": "user", "content": "w" * n}]

    made = c.post("/v1/conversations", json={"items": items(150_000)}, headers=who)
    assert made.status_code == 200, made.text
    conv = made.json()["id"]
    assert 150_000 < _held(r, FLOODER) < 155_000
    assert c.post(f"/v1/conversations/{conv}/items", json={"items": items(150_000)}, headers=who).status_code == 200
    assert 300_000 < _held(r, FLOODER) < 310_000
    full = c.post(f"/v1/conversations/{conv}/items", json={"items": items(150_000)}, headers=who)
    assert full.status_code == 429 and full.json()["error"]["code"] == "storage_quota", full.text
    assert full.headers["x-should-retry"] == "false"
    assert c.post("/v1/conversations", json={"items": items(150_000)}, headers=who).status_code == 429
    assert c.post("/v1/conversations", json={"items": items(1000)}, headers=_as(c, OTHER)).status_code == 200
    assert c.delete(f"/v1/conversations/{conv}", headers=who).status_code == 200
    assert _held(r, FLOODER) == 0


def test_without_a_quota_flag_a_caller_gets_an_eighth_of_redis_maxmemory(capped: tuple[RedisServer, redis.Redis],
                                                                         stack_factory: StackFactory) -> None:
    """Issue 32: a 64 MiB Redis, no --storage-quota-bytes. One address floods with every kind of counted write (1 MiB
    Durable Streams appends, queued creates with 150 KB prompts) and is refused once it holds an eighth of
    maxmemory, with Redis far from full; another address still writes."""
    server, r = capped
    maxmemory = 64 * 1024 * 1024
    stack = stack_factory(server.url)
    stack.consumer("--forwarded-allow-ips", "127.0.0.1")
    c = stack.client()
    flood = _as(c, FLOODER)
    binary = {**flood, "Content-Type": "application/octet-stream"}
    assert c.put("/v1/stream/flood", headers=binary).status_code == 201
    writes = 0
    while True:
        resp = (c.post("/v1/stream/flood", content=MIB, headers=binary) if writes % 2 == 0
                else _create(c, flood, prompt="p" * 150_000))
        if resp.status_code not in (201, 204):
            break
        writes += 1
        assert writes < 64, "the flood was never refused"
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert err["code"] == "storage_quota" and str(maxmemory // 8) in err["message"], err
    held, used = _held(r, FLOODER), int(r.info("memory")["used_memory"])
    assert maxmemory // 8 - len(MIB) - 64 < held <= maxmemory // 8
    # What Redis holds for the flood (entries, hashes, queued events, its own base) stays far below 80% of it.
    assert used < maxmemory // 4, f"used_memory {used} at the refusal"
    print(f"refused after {writes} writes holding {held} bytes; Redis used_memory {used} of {maxmemory}")
    assert _create(c, _as(c, OTHER)).status_code == 201
    assert c.put("/v1/stream/other", content=MIB, headers={**_as(c, OTHER), "Content-Type": "text/plain"}
                 ).status_code == 201
