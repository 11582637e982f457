"""The Durable Streams view (/v1/stream/{path}) on a real consumer and a real Redis: what a client of the protocol
notices (exact bytes, offsets, statuses, wake-ups), what rsb adds (its generations as read-only streams, API-key
namespaces, limits), and what it must not cost (a Redis connection per waiting reader). The protocol's own
conformance suite runs in test_durable_conformance.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import orjson
import pytest
import redis
from durable_streams import stream as ds_stream
from helpers import connected_readers, create, eventually, read_sse, wait_readers, wait_readers_sync
from servers import Stack, StackFactory

from broker.redis.server import RedisServer
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ds(redis_server: RedisServer, demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One consumer for the module (every test uses its own stream names), long-polls of 10 s, SSE keep-alives
    every 5 s (unless a stream's TTL is shorter)."""
    s = Stack(redis_server.url, demo_model, tmp_path_factory.mktemp("ds"))
    _, url = s.consumer("--ds-long-poll-timeout-s", "10", "--heartbeat-s", "5")
    yield url
    s.close()


def name() -> str:
    return f"/v1/stream/t-{uuid.uuid4().hex}"


def put(c: httpx.Client, path: str, content_type: str = "text/plain", body: bytes = b"",
        **headers: str) -> httpx.Response:
    return c.put(path, content=body, headers={"Content-Type": content_type, **headers})


def post(c: httpx.Client, path: str, body: bytes, content_type: str = "text/plain", **headers: str) -> httpx.Response:
    return c.post(path, content=body, headers={"Content-Type": content_type, **headers})


def test_appends_read_back_whole_or_from_any_offset_they_returned(ds: str) -> None:
    path = name()
    with httpx.Client(base_url=ds, timeout=10) as c:
        r = put(c, path, body=b"hello")
        assert r.status_code == 201 and r.headers["content-type"] == "text/plain"
        assert r.headers["location"] == f"{ds}{path}"
        offsets = [r.headers["stream-next-offset"]]
        for part in (b" brave", b" new", b"\n world"):
            r = post(c, path, part)
            assert r.status_code == 204
            offsets.append(r.headers["stream-next-offset"])
        # Opaque but ordered: fixed-width, strictly increasing as plain strings.
        assert offsets == sorted(offsets) and len(set(offsets)) == 4 and all(len(o) == 33 for o in offsets)
        whole = c.get(path)
        assert whole.content == b"hello brave new\n world" and whole.headers["stream-up-to-date"] == "true"
        assert whole.headers["stream-next-offset"] == offsets[-1]
        for i, off in enumerate(offsets):
            rest = c.get(path, params={"offset": off})
            assert rest.content == b"".join([b"hello", b" brave", b" new", b"\n world"][i + 1:])
        assert c.get(path, headers={"If-None-Match": whole.headers["etag"]}).status_code == 304
        assert c.get(path, params={"offset": "0001_x"}).status_code == 400
        assert post(c, path, b"x", "application/json").status_code == 409  # the stream's type is text/plain

        jpath = name()
        assert put(c, jpath, "application/json", b"[]").status_code == 201
        assert c.get(jpath).json() == []
        assert post(c, jpath, b'[1, [2, 3], {"a": "x\\ny"}]', "application/json").status_code == 204
        assert post(c, jpath, b'"one value"', "application/json; charset=utf-8").status_code == 204
        assert c.get(jpath).json() == [1, [2, 3], {"a": "x\ny"}, "one value"]
        assert post(c, jpath, b"[]", "application/json").status_code == 400
        assert post(c, jpath, b"{nope", "application/json").status_code == 400
        assert post(c, jpath, b"NaN", "application/json").status_code == 400


def test_a_producer_retry_is_stored_once_and_a_zombie_epoch_is_fenced_off(ds: str) -> None:
    path = name()

    def send(body: bytes, epoch: int, seq: int) -> httpx.Response:
        return post(c, path, body, **{"Producer-Id": "agent-7", "Producer-Epoch": str(epoch), "Producer-Seq": str(seq)})

    with httpx.Client(base_url=ds, timeout=10) as c:
        put(c, path)
        assert send(b"a", 0, 0).status_code == 200
        first = send(b"b", 0, 1)
        assert first.status_code == 200 and first.headers["producer-seq"] == "1"
        retry = send(b"b", 0, 1)  # its reply was lost, say: the retry must not store "b" twice
        assert retry.status_code == 204 and retry.headers["producer-seq"] == "1"
        gap = send(b"d", 0, 3)
        assert gap.status_code == 409 and gap.headers["producer-expected-seq"] == "2"
        assert send(b"c", 1, 0).status_code == 200  # a restarted producer: new epoch
        zombie = send(b"z", 0, 2)
        assert zombie.status_code == 403 and zombie.headers["producer-epoch"] == "1"
        closing = post(c, path, b"!", **{"Producer-Id": "agent-7", "Producer-Epoch": "1", "Producer-Seq": "1",
                                        "Stream-Closed": "true"})
        assert closing.status_code == 200 and closing.headers["stream-closed"] == "true"
        again = post(c, path, b"!", **{"Producer-Id": "agent-7", "Producer-Epoch": "1", "Producer-Seq": "1",
                                      "Stream-Closed": "true"})
        assert again.status_code == 204  # the retry of the closing request succeeds again
        assert post(c, path, b"late").status_code == 409
        r = c.get(path)
        assert r.content == b"abc!" and r.headers["stream-closed"] == "true"


def test_a_long_poll_is_woken_by_an_append_and_by_a_close_not_by_its_timeout(ds: str) -> None:
    path = name()
    with httpx.Client(base_url=ds, timeout=30) as c, concurrent.futures.ThreadPoolExecutor(2) as pool:
        tail = put(c, path).headers["stream-next-offset"]

        def poll(offset: str) -> tuple[httpx.Response, float]:
            t0 = time.monotonic()
            r = c.get(path, params={"offset": offset, "live": "long-poll"})
            return r, time.monotonic() - t0

        readers = connected_readers(ds)
        waiting = pool.submit(poll, tail)
        wait_readers_sync(ds, readers + 1)  # the long-poll is waiting on the stream
        assert not waiting.done()
        post(c, path, b"news")
        r, took = waiting.result(timeout=5)
        assert r.status_code == 200 and r.content == b"news" and took < 5  # the timeout is 10 s
        assert r.headers["stream-cursor"].isdigit() and r.headers["stream-up-to-date"] == "true"

        eventually(lambda: connected_readers(ds) == readers, 5, "the first long-poll counted out")
        waiting = pool.submit(poll, r.headers["stream-next-offset"])
        wait_readers_sync(ds, readers + 1)
        assert not waiting.done()
        assert c.post(path, headers={"Stream-Closed": "true"}).status_code == 204
        r, took = waiting.result(timeout=5)
        assert r.status_code == 204 and r.headers["stream-closed"] == "true" and took < 5
        r, took = poll(r.headers["stream-next-offset"])  # at the end of a closed stream: never waits
        assert r.status_code == 204 and r.headers["stream-closed"] == "true" and took < 2


def test_sse_frames_each_data_event_with_its_control_and_ends_after_the_close(ds: str) -> None:
    path = name()
    with httpx.Client(base_url=ds, timeout=30) as c:
        put(c, path, body=b"line one\n  indented")
        with c.stream("GET", path, params={"offset": "-1", "live": "sse"}) as r:
            assert r.headers["content-type"] == "text/event-stream"
            assert "stream-sse-data-encoding" not in r.headers
            raw = b""
            chunks = r.iter_raw()
            while b"event: control" not in raw:
                raw += next(chunks)
            post(c, path, b"last", **{"Stream-Closed": "true"})
            raw += b"".join(chunks)  # the server ends the response after the final control event
    blocks = [b for b in raw.split(b"\n\n") if b]
    assert blocks[0] == b"event: data\ndata:line one\ndata:  indented"  # data: without a space keeps both
    first_control = orjson.loads(blocks[1].split(b"data:", 1)[1])
    assert first_control["upToDate"] is True and first_control["streamCursor"].isdigit()
    assert blocks[-2] == b"event: data\ndata:last"
    final = orjson.loads(blocks[-1].split(b"data:", 1)[1])
    assert final == {"streamNextOffset": final["streamNextOffset"], "streamClosed": True}
    kinds = [b.split(b"\n", 1)[0] for b in blocks]
    assert all(kinds[i + 1] == b"event: control" for i, k in enumerate(kinds) if k == b"event: data")


def test_an_open_sse_reader_keeps_a_short_ttl_stream_alive_and_it_expires_after(ds: str) -> None:
    path = name()
    with httpx.Client(base_url=ds, timeout=30) as c:
        assert c.put(path, headers={"Content-Type": "text/plain", "Stream-TTL": "1"}).status_code == 201
        with c.stream("GET", path, params={"offset": "now", "live": "sse"}) as r:
            chunks = r.iter_raw()
            t0 = time.monotonic()
            controls = 0
            while time.monotonic() - t0 < 3:  # three TTLs with no append: the reader's keep-alives are reads
                controls += next(chunks).count(b"event: control")
            assert controls >= 4
            assert c.head(path).status_code == 200
        # No reader, no write: the TTL runs out (a HEAD restarts no TTL).
        eventually(lambda: c.head(path).status_code == 404, 10, "the stream expiring")


def test_waiting_long_polls_hold_no_redis_connection_each(ds: str, redis_client: redis.Redis) -> None:
    paths = [name() for _ in range(40)]
    with httpx.Client(base_url=ds, timeout=10) as c:
        tails = [put(c, p).headers["stream-next-offset"] for p in paths]
    baseline = {cl["id"] for cl in redis_client.client_list()}

    async def run() -> list[bytes]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=ds, limits=limits, timeout=30) as ac:
            polls = [asyncio.create_task(ac.get(paths[i % 40], params={"offset": tails[i % 40], "live": "long-poll"}))
                     for i in range(200)]
            await wait_readers(ac, 200, 20)  # every long-poll is waiting
            conns = [cl for cl in redis_client.client_list() if cl["id"] not in baseline]
            assert len(conns) <= 8, [cl["cmd"] for cl in conns]  # the pool (7) and the one pub/sub connection
            for i, p in enumerate(paths):
                await ac.post(p, content=f"n{i}".encode(), headers={"Content-Type": "text/plain"})
            return [r.content for r in await asyncio.gather(*polls)]

    assert asyncio.run(run()) == [f"n{i % 40}".encode() for i in range(200)]


def test_a_fork_copies_history_and_keeps_its_deleted_source_readable_only_to_itself(ds: str) -> None:
    src, fork = name(), name()
    with httpx.Client(base_url=ds, timeout=10) as c:
        put(c, src, body=b"a")
        at = post(c, src, b"b").headers["stream-next-offset"]
        post(c, src, b"c")
        r = c.put(fork, headers={"Stream-Forked-From": src, "Stream-Fork-Offset": at})
        assert r.status_code == 201 and r.headers["content-type"] == "text/plain"
        post(c, fork, b"X")
        post(c, src, b"d")
        assert c.get(fork).content == b"abX" and c.get(src).content == b"abcd"
        assert c.delete(src).status_code == 204
        assert c.head(src).status_code == 410 and put(c, src).status_code == 409  # soft-deleted: the fork needs it
        assert c.get(fork).content == b"abX"
        assert c.delete(fork).status_code == 204
        assert c.head(src).status_code == 404 and put(c, src).status_code == 201  # its last fork gone: collected


def test_each_api_key_has_its_own_paths_and_its_own_limits(stack_factory: StackFactory, redis_server: RedisServer,
                                                          redis_client: redis.Redis, tmp_path: Path) -> None:
    alice, alice_entry = cast("tuple[str, dict[str, Any]]", new_key("alice"))
    bob, bob_entry = new_key("bob")
    alice_entry["limits"] = {"max_ds_streams": 2}
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [alice_entry, bob_entry]}))
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys), "--max-streams-per-ip", "2", "--ds-long-poll-timeout-s", "10",
               "--ds-max-body-bytes", "1000", "--ds-max-stream-bytes", "400")
    a = httpx.Client(base_url=s.base_url, headers={"Authorization": f"Bearer {alice}"}, timeout=30)
    b = httpx.Client(base_url=s.base_url, headers={"Authorization": f"Bearer {bob}"}, timeout=30)
    with a, b, concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert httpx.put(f"{s.base_url}/v1/stream/x").status_code == 401
        assert put(a, "/v1/stream/x", body=b"alice's").status_code == 201
        assert b.get("/v1/stream/x").status_code == 404  # another key's stream does not exist for bob
        assert put(b, "/v1/stream/x", "application/json").status_code == 201  # his own /x
        assert a.get("/v1/stream/x").content == b"alice's"
        assert put(a, "/v1/stream/y").status_code == 201
        over = put(a, "/v1/stream/z")
        assert over.status_code == 429 and over.json()["error"]["code"] == "too_many_streams"
        assert a.delete("/v1/stream/y").status_code == 204 and put(a, "/v1/stream/z").status_code == 201

        assert post(a, "/v1/stream/x", b"x" * 1001).status_code == 413  # body
        assert post(a, "/v1/stream/x", b"x" * (8 << 20)).status_code == 413  # read and dropped: no reset
        assert post(a, "/v1/stream/x", b"x" * 200).status_code == 204
        assert post(a, "/v1/stream/x", b"x" * 200).status_code == 413  # the stream's size

        # Long-polls count against the same per-address limit as SSE readers.
        tail = a.head("/v1/stream/z").headers["stream-next-offset"]
        polls = [pool.submit(a.get, "/v1/stream/z", params={"offset": tail, "live": "long-poll"}) for _ in range(2)]
        wait_readers_sync(s.base_url, 2, headers={"Authorization": f"Bearer {alice}"})
        third = b.get("/v1/stream/x", params={"offset": "now", "live": "sse"})
        assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_connections"
        post(a, "/v1/stream/z", b"wake")
        assert [f.result(timeout=5).content for f in polls] == [b"wake", b"wake"]


def test_an_rsb_generation_reads_as_a_closed_json_stream_and_resumes_with_the_python_client(stack: Stack) -> None:
    with stack.client() as c:
        sid = create(c, max_tokens=400).json()["id"]
    url = f"{stack.base_url}/v1/stream/rsb/{sid}"
    # The PyPI client follows the answer as it is generated, stops partway, and resumes from its saved offset.
    seen: list[dict[str, Any]] = []
    with ds_stream(url, offset="-1", live="long-poll") as res:
        for ev in res.iter_events(mode="json"):
            seen.extend(ev.data)
            saved = ev.next_offset
            if len(seen) >= 3:
                break
    with ds_stream(url, offset=saved, live="long-poll") as res:
        for ev in res.iter_events(mode="json"):
            seen.extend(ev.data)
            if seen[-1]["type"] in ("done", "cancelled", "error"):  # 0.1.0 does not stop at Stream-Closed itself
                break
    with stack.client() as c:
        native = read_sse(c, f"/v1/streams/{sid}/events")
        assert c.post(f"/v1/stream/rsb/{sid}", content=b"x", headers={"Content-Type": "application/json"}
                      ).status_code == 405
        assert c.get(f"/v1/stream/rsb/{uuid.uuid4()}").status_code == 404
    expected = [{"id": e.id, "type": e.event, "data": e.data} for e in native.events]
    assert seen == expected and seen[-1]["type"] == "done"
    assert "".join(i["data"]["text"] for i in seen if i["type"] == "delta") == native.text
    with ds_stream(url, live=False) as res:  # catch-up of the whole, finished answer
        assert res.read_json() == expected
    # Offsets are the native event ids: a client can hand over to /v1/streams/{id}/events and back.
    ms, seq = expected[2]["id"].split("-")
    offset = f"{int(ms):016d}_{int(seq):016d}"
    with httpx.Client(timeout=10) as c:
        rest = c.get(url, params={"offset": offset})
        assert rest.json() == expected[3:] and rest.headers["stream-closed"] == "true"
        sse = c.get(url, params={"offset": offset, "live": "sse"})
        assert sse.text.endswith('"streamClosed":true}\n\n')
