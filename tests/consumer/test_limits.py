"""Limits enforced at exactly their values, with clear errors; read tokens; CORS."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, cast

import httpx
import orjson
import pytest
import redis
from helpers import create, eventually, read_sse, wait_status
from servers import Stack, StackFactory

from broker.redis.server import RedisServer
from consumer.edge.auth import new_key
from consumer.edge.limits import REFUSAL_BYTES_PER_UNIT, RefusalBudget, TrustedProxies, address_group


def _keys_file(tmp_path: Path, alice_limits: dict[str, Any]) -> tuple[Path, str, str]:
    """A keys file of two keys, alice's with these limits and bob's with none; and their tokens."""
    alice, alice_entry = cast("tuple[str, dict[str, Any]]", new_key("alice"))  # a JSON entry: limits go in it
    bob, bob_entry = new_key("bob")
    alice_entry["limits"] = alice_limits
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [alice_entry, bob_entry]}))
    return keys, alice, bob


# A stack with limits on, and the headers that send alice's key (limited) and bob's.
Limited = tuple[Stack, dict[str, str], dict[str, str]]


@pytest.fixture
def limited(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> Limited:
    keys, alice, bob = _keys_file(tmp_path, {"max_tokens": 50, "max_sse": 3})
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys), "--max-messages", "3", "--max-prompt-chars", "100",
               "--max-streams-per-ip", "5", "--cors-origins", "https://app.example", "--read-token-ttl-s", "2")
    return s, {"Authorization": f"Bearer {alice}"}, {"Authorization": f"Bearer {bob}"}


def _open(url: str, n: int, headers: dict[str, str], sid: str) -> tuple[list[httpx.Client], list[int]]:
    """Open n SSE connections and keep them open; returns the clients and the status codes."""
    clients, codes = [], []
    for _ in range(n):
        cl = httpx.Client(base_url=url, headers=headers, timeout=10)
        resp = cl.send(cl.build_request("GET", f"/v1/streams/{sid}/events"), stream=True)
        codes.append(resp.status_code)
        if resp.status_code == 200:
            clients.append(cl)  # kept open until the caller closes it
        else:
            resp.read()
            cl.close()
    return clients, codes


def test_request_limits_at_exactly_their_values(limited: Limited) -> None:
    s, alice, bob = limited
    with s.client() as c:
        c.headers.update(alice)
        assert create(c, max_tokens=50).status_code == 201
        r = create(c, max_tokens=51)  # alice's key caps max_tokens at 50
        assert r.status_code == 400 and "50" in r.json()["error"]["message"]
        c.headers.update(bob)
        assert create(c, max_tokens=51).status_code == 201  # bob has no such cap
        msgs = [{"role": "user", "content": "x"}] * 3
        assert create(c, messages=msgs).status_code == 201
        assert create(c, messages=msgs + msgs[:1]).status_code == 400
        assert create(c, prompt="p" * 100).status_code == 201
        r = create(c, prompt="p" * 101)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        assert create(c, messages=[{"role": "user", "content": "y" * 60}, {"role": "user", "content": "z" * 41}]
                      ).status_code == 400


def test_open_streams_per_key_and_per_ip_at_exactly_their_limits(limited: Limited) -> None:
    s, alice, bob = limited
    with s.client() as c:
        c.headers.update(alice)
        sid_a = create(c).json()["id"]
        c.headers.update(bob)
        sid_b = create(c).json()["id"]
    opened, codes = _open(s.base_url, 4, alice, sid_a)
    assert codes == [200, 200, 200, 429]  # alice: max_sse 3
    more, codes_b = _open(s.base_url, 3, bob, sid_b)
    assert codes_b == [200, 200, 429]  # 5 per address in all
    r = httpx.get(f"{s.base_url}/v1/streams/{sid_b}/events", headers=bob)
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_connections"
    assert int(r.headers["retry-after"]) >= 1
    for cl in opened + more:
        cl.close()

    def one_more_opens() -> bool:
        clients, codes = _open(s.base_url, 1, alice, sid_a)
        for cl in clients:
            cl.close()
        return codes == [200]

    eventually(one_more_opens, 5, "closed connections counted out: the limit frees up again")


def test_read_tokens_open_one_stream_for_a_short_time(limited: Limited) -> None:
    s, alice, _ = limited
    with s.client() as c:
        c.headers.update(alice)
        body = create(c).json()
        other = create(c).json()
    token = body["read_token"]
    assert body["events_url"] == f"/v1/streams/{body['id']}/events?token={token}"
    with httpx.Client(base_url=s.base_url, timeout=10) as anon:  # like EventSource: no headers
        first = read_sse(anon, body["events_url"], stop_after=1)
        assert first.status == 200 and first.events[0].event == "queued"
        assert anon.get(f"/v1/streams/{body['id']}", params={"token": token}).status_code == 200
        assert anon.get(f"/v1/streams/{other['id']}/events", params={"token": token}).status_code == 401
        assert anon.post(f"/v1/streams/{body['id']}/cancel", params={"token": token}).status_code == 401
        tampered = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
        assert anon.get(f"/v1/streams/{body['id']}", params={"token": tampered}).status_code == 401

        def token_expired() -> bool:
            r = anon.get(f"/v1/streams/{body['id']}", params={"token": token})
            assert r.status_code == 401 and "expired" in r.json()["error"]["message"], (r.status_code, r.text)
            return True

        eventually(token_expired, 10)  # ttl 2 s


def test_cors_allowlist(limited: Limited) -> None:
    s, alice, _ = limited
    pre = httpx.options(f"{s.base_url}/v1/streams", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.get(f"{s.base_url}/v1/streams/{uuid.uuid4()}", headers={"Origin": "https://evil.example", **alice})
    assert "access-control-allow-origin" not in r.headers
    bad = httpx.options(f"{s.base_url}/v1/streams", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert bad.status_code == 400


def test_cors_is_off_by_default(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    r = httpx.get(f"{s.base_url}/healthz", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.timeout(300)
def test_a_flood_from_one_key_leaves_other_keys_streams_unaffected(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
                                                                   slow_model: Path, tmp_path: Path) -> None:
    import asyncio
    import statistics

    keys, alice, bob = _keys_file(tmp_path, {"max_sse": 20})
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys))
    s.generator(model=slow_model)
    a_headers, b_headers = {"Authorization": f"Bearer {alice}"}, {"Authorization": f"Bearer {bob}"}
    with s.client() as c:
        c.headers.update(a_headers)
        target = create(c).json()["id"]  # alice floods reads of her own (queued) stream

    async def bob_stream(max_tokens: int) -> list[float]:
        """Delay from append (the event id's milliseconds) to receipt, per delta of a new bob stream."""
        async with httpx.AsyncClient(base_url=s.base_url, headers=b_headers, timeout=60) as bc:
            sid = (await bc.post("/v1/streams", json={"prompt": "hi", "max_tokens": max_tokens})).json()["id"]
            delays, buf = [], b""
            async with bc.stream("GET", f"/v1/streams/{sid}/events") as r:
                async for chunk in r.aiter_raw():
                    now_ms = time.time() * 1000
                    buf += chunk
                    while b"\n\n" in buf:
                        block, buf = buf.split(b"\n\n", 1)
                        if b"event: delta" in block:
                            eid = block.split(b"\n", 1)[0].split(b": ", 1)[1].decode()
                            delays.append(now_ms - int(eid.split("-")[0]))
            return delays

    async def flood() -> list[int]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=s.base_url, headers=a_headers, limits=limits, timeout=60) as ac:
            async def attempt() -> int:
                async with ac.stream("GET", f"/v1/streams/{target}/events") as r:
                    if r.status_code == 200:
                        await asyncio.sleep(1)  # hold the allowed ones open through the flood
                    return r.status_code
            return list(await asyncio.gather(*(attempt() for _ in range(2000))))

    async def scenario() -> tuple[list[float], list[float], list[int], float]:
        before = await bob_stream(1500)
        during_task = asyncio.create_task(bob_stream(1500))
        t0 = time.monotonic()
        codes = await flood()
        flood_ms = (time.monotonic() - t0) * 1000
        return before, await during_task, codes, flood_ms

    before, during, codes, flood_ms = asyncio.run(scenario())
    # The key's limit (exact, see test_open_streams_per_key_and_per_ip_at_exactly_their_limits) refuses most
    # of the flood with 429; nothing else comes back.
    assert set(codes) == {200, 429} and codes.count(429) > 1000
    assert len(before) > 100 and len(during) > 100  # bob's answers arrived whole
    p99 = lambda xs: statistics.quantiles(xs, n=100)[98]  # noqa: E731
    print(f"bob's delivery delay p99: before {p99(before):.1f} ms, during the flood {p99(during):.1f} ms "
          f"(the flood took {flood_ms:.0f} ms)")
    # Each refused attempt still costs the pod ~0.4 ms of CPU (accept, parse, auth, 429), and here the
    # flooding client shares the 2 cores: a burst of 2,000 delays other keys' events by up to about the
    # burst's CPU time, but loses or breaks nothing (docs/security.md has the numbers). On a quiet machine
    # that is under 2.5 s; on a loaded one (a test suite in parallel beside it) the burst itself takes longer,
    # and the bound is that bob's events were never held for the whole of it: they kept flowing.
    assert p99(during) < max(2500.0, 0.9 * flood_ms)


def test_unfinished_generations_per_key_at_exactly_max_active(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    keys, alice, bob = _keys_file(tmp_path, {"max_active": 2})
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys))  # no generator yet: everything stays queued
    with s.client() as c:
        c.headers.update({"Authorization": f"Bearer {alice}"})
        first = [create(c, max_tokens=4) for _ in range(2)]
        assert [r.status_code for r in first] == [201, 201]
        r = create(c, max_tokens=4)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_generations"
        assert int(r.headers["retry-after"]) >= 1
        again = c.post("/v1/streams", json={"id": first[0].json()["id"], "prompt": "Hello", "max_tokens": 4})
        assert again.status_code == 200  # a retry of an accepted create needs no new slot
        c.headers.update({"Authorization": f"Bearer {bob}"})
        assert create(c).status_code == 201  # other keys are not limited by alice's use
        c.headers.update({"Authorization": f"Bearer {alice}"})
        assert c.post(f"/v1/streams/{first[0].json()['id']}/cancel").json()["status"] == "cancelled"
        assert create(c, max_tokens=4).status_code == 201  # a finished one frees its slot
        assert create(c, max_tokens=4).status_code == 429
        s.generator()
        wait_status(c, first[1].json()["id"], {"done"})
        eventually(lambda: create(c, max_tokens=4).status_code == 201, 30, "a done generation freeing its slot")


def test_with_keys_the_create_rate_is_per_key_and_a_key_may_override_it(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    keys, alice, bob = _keys_file(tmp_path, {"create_burst": 2, "create_rate_per_s": 0.01})
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys))
    with s.client() as c:
        c.headers.update({"Authorization": f"Bearer {alice}"})
        codes = [create(c).status_code for _ in range(3)]
        assert codes == [201, 201, 429]
        r = create(c)
        assert r.json()["error"]["code"] == "rate_limited" and int(r.headers["retry-after"]) >= 60
        c.headers.update({"Authorization": f"Bearer {bob}"})  # same address, another key: its own share
        assert [create(c).status_code for _ in range(5)] == [201] * 5


def test_an_address_group_is_an_ipv4_address_or_an_ipv6_64() -> None:
    assert address_group("203.0.113.9") == "203.0.113.9"
    assert address_group("2001:db8:1:2::1") == address_group("2001:db8:1:2:ffff::7") == "2001:db8:1:2::/64"
    assert address_group("2001:db8:1:3::1") != address_group("2001:db8:1:2::1")
    assert address_group("::ffff:198.51.100.4") == "198.51.100.4"
    assert address_group("/run/rsb.sock") == "/run/rsb.sock"
    proxies = TrustedProxies(["127.0.0.1", "10.0.0.0/8", "fd00::/8", "/run/nginx.sock"])
    assert "127.0.0.1" in proxies and "10.1.2.3" in proxies and "fd12::1" in proxies
    assert "/run/nginx.sock" in proxies and "127.0.0.2" not in proxies and "11.0.0.1" not in proxies
    assert "8.8.8.8" in TrustedProxies(["*"])


def test_a_refusal_budget_charges_refusals_by_their_size_refills_and_stays_bounded() -> None:
    now = [0.0]
    budget = RefusalBudget(10, 2.0, max_senders=4, clock=lambda: now[0])
    assert budget.enabled and not RefusalBudget(0, 1.0).enabled
    for _ in range(9):
        budget.charge("a", 100)
    assert budget.retry_after_s("a") is None  # one unit left
    budget.charge("a", 2 * REFUSAL_BYTES_PER_UNIT)  # 3 units: 2 in debt
    assert budget.retry_after_s("a") == 2  # (1 - (-2)) / 2 per s, rounded up
    assert budget.retry_after_s("b") is None  # another address has its own
    now[0] += 1.0
    assert budget.retry_after_s("a") == 1
    now[0] += 0.6
    assert budget.retry_after_s("a") is None
    now[0] += 100
    for who in "bcdef":  # past max_senders: those refilled are forgotten first
        budget.charge(who, 0)
    assert budget.retry_after_s("a") is None and len(budget._senders) <= 4
