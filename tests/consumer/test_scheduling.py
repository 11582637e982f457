"""The scheduler end to end, as a user meets it: real generators serving different models, a real consumer, the
OpenAI client. Every job runs on a worker of the model it names (or its alias's), a model nobody serves is a 404
that stores nothing, a pool that is down keeps its jobs queued without delaying the others, tenants take turns,
tiers keep their order, and a SIGKILLed worker's job continues on a worker of the same model."""

from __future__ import annotations

import signal
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
from helpers import create, eventually, read_sse, stored_events
from servers import Stack, StackFactory

from broker.redis.server import RedisServer
from broker.streams.keys import queue_stats_key
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow


def _started(c: httpx.Client, sid: str, headers: dict[str, str] | None = None, tier: str = "default"
             ) -> tuple[str, str]:
    """(the started event's id, the model it names), once the stream ended; it names ``tier`` too."""
    full = read_sse(c, f"/v1/streams/{sid}/events", headers=headers)
    assert full.events[-1].event == "done", [e.event for e in full.events]
    [(eid, data)] = [(i, e.data) for i, e in zip(full.ids, full.events, strict=True) if e.event == "started"]
    assert data["service_tier"] == tier
    return eid, data["model"]


def _order(eid: str) -> tuple[int, int]:
    ms, seq = eid.split("-")
    return int(ms), int(seq)


def _two_pools(s: Stack, slow_model: Path, *gen: str) -> None:
    s.generator("--model-name", "alpha", *gen)
    s.generator("--model-name", "beta", "--model-alias", "beta-latest", *gen, model=slow_model)


def test_each_job_runs_on_a_worker_of_the_model_it_names(stack_factory: StackFactory, redis_server: RedisServer,
                                                         redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    _two_pools(s, slow_model)
    s.consumer(test_default=False)
    client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0)
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"alpha", "beta", "beta-latest"}
    assert (client.models.retrieve("beta-latest").model_extra or {}).get("root") == "beta"
    for name, ran in (("alpha", "alpha"), ("beta", "beta"), ("beta-latest", "beta")) * 3:
        answer = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
        assert answer.model == ran  # the model that ran, never the name asked for
        assert answer.service_tier == "default"
        sid = answer.id.removeprefix("chatcmpl-")
        with s.client() as c:
            assert _started(c, str(uuid.UUID(sid)))[1] == ran
    # A model nobody serves: OpenAI's 404, and nothing stored or queued. (No new key: one with a TTL, such as a
    # rate window's, may expire meanwhile.)
    keys_before = set(redis_client.keys("*"))
    for unknown in ("gpt-5", "gpt-4o"):
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model=unknown, messages=[{"role": "user", "content": "hi"}])
        assert e.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(unknown)
    with s.client() as c:
        r = create(c, model="gpt-5")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # Two models and no --default-model: a create must name one.
        r = create(c)
        assert r.status_code == 400 and "alpha" in r.json()["error"]["message"]
    assert set(redis_client.keys("*")) <= keys_before


def test_a_pool_that_is_down_keeps_its_jobs_and_delays_no_other(stack_factory: StackFactory,
                                                                 redis_server: RedisServer,
                                                                 redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.generator("--model-name", "alpha")
    beta = s.generator("--model-name", "beta", model=slow_model)
    s.consumer(test_default=False)
    beta.signal(signal.SIGTERM)
    beta.wait(30)
    with s.client() as c:
        waiting = [create(c, model="beta", max_tokens=8).json()["id"] for _ in range(3)]
        # Alpha's requests run now, not behind beta's jobs: each ends while beta's are still queued.
        for _ in range(4):
            sid = create(c, model="alpha", max_tokens=8).json()["id"]
            assert _started(c, sid)[1] == "alpha"
        for sid in waiting:
            assert c.get(f"/v1/streams/{sid}").json()["status"] == "queued"
        first = read_sse(c, f"/v1/streams/{waiting[2]}/events", stop_after=1)
        assert [e.data["position"] for e in first.events if e.event == "queued"] == [3]
    # Its worker comes back: its jobs run there, and only there.
    s.generator("--model-name", "beta", model=slow_model)
    with s.client() as c:
        assert {_started(c, sid)[1] for sid in waiting} == {"beta"}


def test_a_tenant_with_a_backlog_delays_another_by_about_one_job(stack_factory: StackFactory,
                                                                 redis_server: RedisServer,
                                                                 redis_client: redis.Redis, slow_model: Path,
                                                                 tmp_path: Path) -> None:
    alice, alice_entry = new_key("alice")
    bob, bob_entry = new_key("bob")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [alice_entry, bob_entry]}))
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys), "--default-model", "alpha", test_default=False)
    a, b = {"Authorization": f"Bearer {alice}"}, {"Authorization": f"Bearer {bob}"}
    with s.client() as c:
        def make(headers: dict[str, str]) -> str:
            r = c.post("/v1/streams", json={"id": str(uuid.uuid4()), "prompt": "Hello", "max_tokens": 16},
                       headers=headers)
            assert r.status_code == 201, r.text
            return str(r.json()["id"])

        # Queued before any worker runs: the order is the scheduler's alone, whatever the machine's speed.
        alices = [make(a) for _ in range(8)]
        bobs = make(b)
        queued = read_sse(c, f"/v1/streams/{bobs}/events", headers=b, stop_after=1)
        assert [e.data["position"] for e in queued.events if e.event == "queued"] == [2]
    s.generator("--model-name", "alpha", model=slow_model)
    with s.client() as c:
        started = {sid: _order(_started(c, sid, a)[0]) for sid in alices}
        bob_started = _order(_started(c, bobs, b)[0])
    ahead = sum(1 for t in started.values() if t < bob_started)
    assert ahead == 1, f"bob's one job waited behind {ahead} of alice's 8 (first come first served: 8)"


def test_priority_before_default_before_flex_and_the_tier_is_echoed(stack_factory: StackFactory,
                                                                    redis_server: RedisServer,
                                                                    redis_client: redis.Redis,
                                                                    tmp_path: Path) -> None:
    gold, gold_entry = new_key("gold")
    basic, basic_entry = new_key("basic")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [{**gold_entry, "service_tier": "priority",
                                             "service_tiers": ["priority", "default"]},
                                            {**basic_entry, "service_tiers": ["default", "flex"]}]}))
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys), "--default-model", "alpha", test_default=False)
    g = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=gold, max_retries=0)
    bc = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=basic, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        g.responses.create(model="alpha", input="hi", service_tier="flex")  # not one of gold's tiers
    assert "service_tier" in e.value.message
    with pytest.raises(openai.BadRequestError):
        bc.responses.create(model="alpha", input="hi", service_tier="scale")
    flex = [bc.responses.create(model="alpha", input="hi", service_tier="flex", background=True, max_output_tokens=8)
            for _ in range(2)]
    default = [bc.responses.create(model="alpha", input="hi", background=True, max_output_tokens=8)
               for _ in range(2)]
    auto = g.responses.create(model="alpha", input="hi", service_tier="auto", background=True, max_output_tokens=8)
    assert [r.service_tier for r in flex + default + [auto]] == ["flex", "flex", "default", "default", "priority"]
    s.generator("--model-name", "alpha")
    with s.client() as c:
        def started(r: Any, key: str, tier: str) -> tuple[tuple[int, int], str]:
            sid = str(uuid.UUID(r.id.removeprefix("resp_")))
            return _order(_started(c, sid, {"Authorization": f"Bearer {key}"}, tier)[0]), tier

        order = sorted([started(r, basic, "flex") for r in flex] + [started(r, basic, "default") for r in default]
                       + [started(auto, gold, "priority")])
    assert [t for _, t in order] == ["priority", "default", "default", "flex", "flex"]
    done = g.responses.retrieve(auto.id)
    assert done.status == "incomplete" and done.service_tier == "priority"  # max_output_tokens reached


def test_a_key_flooding_priority_is_served_default_and_delays_another_by_one_job(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path,
        tmp_path: Path) -> None:
    """Priority is the operator's to hand out (``service_tiers``), never a client's to take: a key without it, and a
    caller without a key, asking for it are served, echoed and billed as ``default``; so a flood of "priority" jobs
    waits its turn among the tenants like any other (before: every one of them ran before another key's job)."""
    mallory, mallory_entry = new_key("mallory")
    bob, bob_entry = new_key("bob")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [mallory_entry, {**bob_entry, "service_tiers": ["default", "flex"]}]}))
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys), "--default-model", "alpha", test_default=False)
    _, open_url = s.consumer("--default-model", "alpha", test_default=False)  # no keys: anonymous callers
    m, b = {"Authorization": f"Bearer {mallory}"}, {"Authorization": f"Bearer {bob}"}
    sdk = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=mallory, max_retries=0)
    with s.client() as c, s.client(open_url) as anon:
        def make(client: httpx.Client, headers: dict[str, str], tier: str | None) -> str:
            body = {"id": str(uuid.uuid4()), "prompt": "Hello", "max_tokens": 16, "service_tier": tier}
            r = client.post("/v1/streams", json=body, headers=headers)
            assert r.status_code == 201, r.text  # not refused
            return str(r.json()["id"])

        # Queued before any worker runs: the order is the scheduler's alone, whatever the machine's speed.
        floods = [make(c, m, "priority") for _ in range(7)]
        # A streamed chat completion holds its status line until a generator counted its prompt: its first chunk is
        # read once one runs (below); its job is queued at once, before bob's.
        chunks: list[Any] = []

        def chat() -> None:
            stream = sdk.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, service_tier="priority", stream=True)
            chunks.append(next(iter(stream)))
            stream.close()

        chatting = threading.Thread(target=chat)
        chatting.start()
        eventually(lambda: int(redis_client.hget(queue_stats_key(0, 1), "waiting") or 0) == 8, 10, "the chat queued")
        bobs = make(c, b, None)
        queued = read_sse(c, f"/v1/streams/{bobs}/events", headers=b, stop_after=1)
        assert [e.data["position"] for e in queued.events if e.event == "queued"] == [2]
        anonymous = make(anon, {}, "priority")
    s.generator("--model-name", "alpha", model=slow_model)
    chatting.join(60)
    [first] = chunks
    assert first.service_tier == "default"
    floods.append(str(uuid.UUID(first.id.removeprefix("chatcmpl-"))))
    with s.client() as c, s.client(open_url) as anon:
        started = {sid: _order(_started(c, sid, m, "default")[0]) for sid in floods}
        bob_started = _order(_started(c, bobs, b)[0])
        _started(anon, anonymous, None, "default")
        rows = c.get("/v1/reports/usage", params={"group_by": "key,tier"}, headers=m).json()["rows"]
    ahead = sum(1 for t in started.values() if t < bob_started)
    assert ahead <= 1, f"bob's one job waited behind {ahead} of mallory's 8 'priority' jobs"
    assert [(r["key"], r["tier"], r["streams"]) for r in rows] == [("mallory", "default", 8)]


def test_a_sigkilled_workers_job_continues_on_a_worker_of_the_same_model(stack_factory: StackFactory,
                                                                       redis_server: RedisServer,
                                                                       redis_client: redis.Redis,
                                                                       slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    first = s.generator("--model-name", "alpha", "--lease-s", "2", model=slow_model)
    s.generator("--model-name", "beta", "--lease-s", "2", model=slow_model)
    s.consumer(test_default=False)
    with s.client() as c:
        sid = create(c, model="alpha", max_tokens=3000).json()["id"]
        eventually(lambda: any(e.type == "delta" for e in stored_events(redis_client, sid)), 30, "mid-answer")
        first.signal(signal.SIGKILL)
        first.wait(10)
        s.generator("--model-name", "alpha", "--lease-s", "2", model=slow_model)
        full = read_sse(c, f"/v1/streams/{sid}/events", timeout_s=120)
    assert full.events[-1].event == "done"
    models = [e.data["model"] for e in full.events if e.event == "started"]
    assert models and set(models) == {"alpha"}, models
    assert full.events[-1].data["usage"]["completion_tokens"] == 3000
