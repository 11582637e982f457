"""API keys and tenants: no key or a wrong key is 401; another tenant's stream does not exist for you."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from helpers import create, read_sse, wait_status
from servers import Stack, StackFactory

from broker.redis.server import RedisServer
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow

# A stack whose consumer knows two API keys, and the headers that send each.
Tenants = tuple[Stack, dict[str, str], dict[str, str]]


@pytest.fixture
def tenants(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> Tenants:
    alice, alice_entry = new_key("alice")
    bob, bob_entry = new_key("bob")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [alice_entry, bob_entry]}))
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys))
    s.generator()
    return s, {"Authorization": f"Bearer {alice}"}, {"Authorization": f"Bearer {bob}"}


def test_missing_or_wrong_keys_get_401(tenants: Tenants) -> None:
    s, alice, _ = tenants
    with s.client() as c:
        for headers in ({}, {"Authorization": "Bearer alice.wrong"}, {"Authorization": "Bearer nobody.x"},
                        {"Authorization": "Basic YWxpY2U6eA=="}, {"Authorization": "Bearer alice"}):
            r = c.post("/v1/streams", json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/healthz").status_code == 200  # operations routes stay open
        assert c.post("/v1/streams", json={"prompt": "x"}, headers=alice).status_code == 201


def test_another_tenants_stream_does_not_exist_for_you(tenants: Tenants) -> None:
    s, alice, bob = tenants
    with s.client() as c:
        c.headers.update(alice)
        sid = create(c, max_tokens=8).json()["id"]
        wait_status(c, sid, {"done"})
        full = read_sse(c, f"/v1/streams/{sid}/events")
        assert full.events[-1].event == "done"
        c.headers.update(bob)
        requests: list[tuple[str, str, dict[str, Any]]] = [
            ("GET", f"/v1/streams/{sid}", {}), ("GET", f"/v1/streams/{sid}/events", {}),
            ("GET", f"/v1/streams/{sid}/events", {"headers": {"Last-Event-ID": full.ids[1]}}),
            ("POST", f"/v1/streams/{sid}/cancel", {})]
        for method, path, kwargs in requests:
            r = c.request(method, path, **kwargs)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path)
        # Re-creating alice's id as bob, even with alice's exact body, is a conflict that tells nothing.
        r = c.post("/v1/streams", json={"id": sid, "prompt": "Hello", "max_tokens": 8})
        assert r.status_code == 409 and "status" not in r.json() and "done" not in r.text
        report = c.get("/v1/reports/aborted").json()
        assert report["total"]["streams"] == 0
