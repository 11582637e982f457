"""Admission and cost: queue positions, 429, abandoned and disconnected readers, the aborted report,
retention. Real consumer and generator processes on a real redis-server."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
import redis
from helpers import create, eventually, read_sse, wait_status
from servers import StackFactory

from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow


def test_queued_positions_count_down_then_started(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    with s.client() as c:
        sids = [create(c, max_tokens=150).json()["id"] for _ in range(5)]
        s.generator(model=slow_model)
        last = read_sse(c, f"/v1/streams/{sids[-1]}/events")
        first = read_sse(c, f"/v1/streams/{sids[0]}/events")
    positions = [e.data["position"] for e in last.events if e.event == "queued"]
    assert positions == [5, 4, 3, 2, 1]
    types = [e.event for e in last.events]
    assert types[: len(positions) + 1] == ["queued"] * 5 + ["started"]
    assert [e.data["position"] for e in first.events if e.event == "queued"] == [1]
    # Once jobs have finished, the ETA is an estimate from the observed job time.
    etas = [e.data["eta_s"] for e in last.events if e.event == "queued"]
    assert etas[0] is None and etas[-1] is not None and etas[-1] > 0


def test_a_full_queue_answers_429_with_retry_after(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer("--max-queue", "3")
    with s.client() as c:
        assert [create(c).status_code for _ in range(3)] == [201] * 3
        r = create(c)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        # A retry of an accepted create is still answered (it needs no queue slot).
        assert c.get("/metrics").status_code == 200


def test_cancel_on_disconnect_cancels_when_the_last_reader_leaves(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator("--lease-s", "1", "--disconnect-grace-s", "1", model=slow_model)
    with s.client() as c:
        sid = create(c, max_tokens=3000, cancel_on_disconnect=True).json()["id"]
        head = read_sse(c, f"/v1/streams/{sid}/events", stop_after=10)  # then the reader leaves
        st = wait_status(c, sid, {"cancelled", "done"}, timeout_s=20)
        assert st["status"] == "cancelled"
        events = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": head.ids[-1]}).events
        assert events[-1].event == "cancelled" and events[-1].data["reason"] == "disconnect"
        assert events[-1].data["usage"]["completion_tokens"] < 3000


def test_a_reconnect_within_the_grace_keeps_a_cancel_on_disconnect_stream(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator("--lease-s", "1", "--disconnect-grace-s", "3", model=slow_model)
    with s.client() as c:
        sid = create(c, max_tokens=2000, cancel_on_disconnect=True).json()["id"]
        last = read_sse(c, f"/v1/streams/{sid}/events", stop_after=5).ids[-1]
        while True:  # reconnect at once, again and again, like a flaky network
            part = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": last}, stop_after=200)
            if part.status == 204 or not part.events:
                break
            last = part.ids[-1]
            if part.events[-1].event in ("done", "cancelled", "error"):
                break
        assert c.get(f"/v1/streams/{sid}").json()["status"] == "done"


def test_nobody_reading_for_abandon_after_s_cancels_as_abandoned(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer("--abandon-after-s", "1")
    s.generator("--lease-s", "1", model=slow_model)
    with s.client() as c:
        sid = create(c, max_tokens=3000).json()["id"]
        st = wait_status(c, sid, {"cancelled", "done"}, timeout_s=20)
        assert st["status"] == "cancelled"
        events = read_sse(c, f"/v1/streams/{sid}/events").events
        assert events[-1].data["reason"] == "abandoned"
        # A stream with a reader is not abandoned.
        sid2 = create(c, max_tokens=1500).json()["id"]
        assert read_sse(c, f"/v1/streams/{sid2}/events").events[-1].event == "done"


def test_aborted_report_equals_the_sums_of_the_aborted_streams(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator(model=slow_model)
    with s.client() as c:
        a = create(c, max_tokens=2000).json()["id"]
        read_sse(c, f"/v1/streams/{a}/events", stop_after=20)
        b = create(c, max_tokens=700).json()["id"]  # waits behind a
        assert c.post(f"/v1/streams/{b}/cancel").json()["status"] == "cancelled"
        c.post(f"/v1/streams/{a}/cancel")
        ua = wait_status(c, a, {"cancelled"})["usage"]
        done = create(c, max_tokens=10).json()["id"]
        wait_status(c, done, {"done"})
        report = c.get("/v1/reports/aborted", params={"group_by": "reason"}).json()
        assert report["rows"] == [{
            "reason": "client", "streams": 2, "prompt_tokens": ua["prompt_tokens"],
            "completion_tokens": ua["completion_tokens"],
            "tokens_saved": (2000 - ua["completion_tokens"]) + 700,
            "compute_s": report["rows"][0]["compute_s"],
        }]
        assert 0 < report["rows"][0]["compute_s"] < 30
        assert report["total"] == {k: v for k, v in report["rows"][0].items() if k != "reason"}
        by_model = c.get("/v1/reports/aborted", params={"group_by": "model"}).json()
        assert by_model["total"] == report["total"] and len(by_model["rows"]) >= 1
        by_day = c.get("/v1/reports/aborted", params={"group_by": "day"}).json()
        assert [r["day"] for r in by_day["rows"]] == [time.strftime("%Y-%m-%d", time.gmtime())]
        empty = c.get("/v1/reports/aborted", params={"since": str(time.time() + 60)}).json()
        assert empty["rows"] == [] and empty["total"]["streams"] == 0
        bad = c.get("/v1/reports/aborted", params={"group_by": "color"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
        metrics = c.get("/metrics").text
        assert 'rsb_aborted_streams_total{reason="client"} 2' in metrics
        assert f'rsb_aborted_tokens_saved_total{{reason="client"}} {report["total"]["tokens_saved"]}' in metrics
    cli = subprocess.run([sys.executable, "-m", "rsb", "report", "--redis-url", redis_server.url, "--json"],
                         capture_output=True, text=True, check=True)
    assert orjson.loads(cli.stdout)["total"] == report["total"]
    table = subprocess.run([sys.executable, "-m", "rsb", "report", "--redis-url", redis_server.url],
                           capture_output=True, text=True, check=True).stdout
    assert table.splitlines()[0].split()[:2] == ["reason", "streams"] and "client" in table
    csv = subprocess.run([sys.executable, "-m", "rsb", "report", "--redis-url", redis_server.url, "--csv"],
                         capture_output=True, text=True, check=True).stdout
    assert csv.splitlines()[1].startswith("client,2,")


def _stored_bytes(r: redis.Redis) -> int:
    """What Redis holds in keys (MEMORY USAGE of each). Not INFO's used_memory: that counts connection buffers
    too, which grow and shrink by tens of kilobytes with traffic, more than a short stream holds."""
    return sum(r.memory_usage(k) or 0 for k in r.scan_iter())


def test_after_retention_a_stream_answers_410_and_its_memory_is_returned(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer("--retention-s", "1")
    s.generator()
    with s.client() as c:
        body = {"prompt": "hi", "max_tokens": 20}
        sid = create(c, body).json()["id"]
        wait_status(c, sid, {"done"})
        baseline = _stored_bytes(redis_client)

        def expired(path: str) -> bool:
            r = c.get(path)
            assert r.status_code == 410 and r.json()["error"]["code"] == "expired", (path, r.status_code, r.text)
            return True

        eventually(lambda: expired(f"/v1/streams/{sid}"), 10)  # retention 1 s
        assert expired(f"/v1/streams/{sid}/events")
        again = c.post("/v1/streams", json={"id": sid, **body})
        assert again.status_code == 410
        import uuid

        assert c.get(f"/v1/streams/{uuid.uuid4()}").status_code == 404
        eventually(lambda: c.get(f"/v1/streams/{sid}").status_code == 404, 10, "the tombstone going too")
    leftovers = [k for k in redis_client.keys("*") if sid.encode() in k]
    assert leftovers == []
    assert redis_client.xlen("rsb:{p0}:jobs") == 0  # finished jobs are deleted, not only acknowledged
    assert _stored_bytes(redis_client) < baseline


def test_readyz_and_healthz(stack_factory: StackFactory, redis_server: RedisServer) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    assert httpx.get(f"{s.base_url}/readyz").json() == {"status": "ready"}
