"""Declared models (``--models``): generators scaled to zero. A create for a declared model is accepted and queued
with no generator alive (its ``queued`` event says ``workers: 0``), ``GET /v1/models`` lists it, and the generator
an autoscaler starts on that backlog runs it; an undeclared, unannounced model is still a 404. A consumer and a
generator started in either order work. The cold start (a generator started after creates queued, to their first
token) is measured and printed: docs/deployment.md quotes it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import httpx
import pytest
from helpers import SSE, create, eventually, read_sse, wait_status
from servers import StackFactory

from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow

MODEL = "story-model"


def _queued(c: httpx.Client, sid: str) -> dict[str, object]:
    events = read_sse(c, f"/v1/streams/{sid}/events", stop_after=1).events
    assert events[0].event == "queued", events
    data: dict[str, object] = events[0].data
    return data


def test_a_declared_model_queues_with_no_generator_and_runs_once_one_starts(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: object) -> None:
    s = stack_factory(redis_server.url)
    s.consumer("--models", MODEL, test_default=False)
    with s.client() as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL]
        assert c.get(f"/v1/models/{MODEL}").status_code == 200
        r = create(c, model="not-declared")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        named = create(c, model=MODEL, max_tokens=8)
        unnamed = create(c, max_tokens=8)  # the one model declared: no --default-model needed
        assert named.status_code == unnamed.status_code == 201, (named.text, unnamed.text)
        sids = [named.json()["id"], unnamed.json()["id"]]
        for sid in sids:
            assert _queued(c, sid) == {"position": 1 + sids.index(sid), "eta_s": None, "workers": 0}
            assert c.get(f"/v1/streams/{sid}").json()["status"] == "queued"

        # The autoscaler's cold start: a generator starts on the backlog; measured to each stream's first token.
        t0 = time.monotonic()
        gen = s.generator("--model-name", MODEL, wait=False)
        firsts: dict[str, float] = {}

        def first_token(sid: str) -> Callable[[SSE], None]:
            def seen(ev: SSE) -> None:
                if ev.event == "delta":
                    firsts.setdefault(sid, time.monotonic() - t0)
            return seen

        for sid in sids:
            read_sse(c, f"/v1/streams/{sid}/events", on_event=first_token(sid))
        assert set(firsts) == set(sids)
        print(f"\ncold start: a generator started with 2 creates queued; first tokens after "
              f"{firsts[sids[0]]:.2f} s and {firsts[sids[1]]:.2f} s")
        for sid in sids:
            assert wait_status(c, sid, {"done"})["model"] == MODEL

        # Now a generator serves it: a create's queued event counts it. Stopped cleanly, it withdraws at once.
        sid = create(c, model=MODEL, max_tokens=4).json()["id"]
        assert _queued(c, sid)["workers"] == 1
        wait_status(c, sid, {"done"})
        gen.stop()
        # Within the 2 s the consumer reuses its list of announced models (MODELS_CACHE_S), not 35 s.
        eventually(lambda: _queued(c, create(c, model=MODEL, max_tokens=4).json()["id"])["workers"] == 0, 5,
                   interval_s=0.5)
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL]


def test_a_generator_started_before_the_consumer_serves_its_declared_model(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: object) -> None:
    s = stack_factory(redis_server.url)
    s.generator("--model-name", MODEL)
    s.consumer("--models", MODEL, test_default=False)
    with s.client() as c:
        sid = create(c, model=MODEL, id=str(uuid.uuid4()), max_tokens=6).json()["id"]
        assert _queued(c, sid)["workers"] == 1
        assert wait_status(c, sid, {"done"})["model"] == MODEL
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL]
