"""Every bad input of the contract gets its status code and a JSON error; none is a 500 or a hang."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import create
from servers import Stack

from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow

BAD_CREATES = [
    (b"{not json", "invalid_request"),
    (b"[]", "invalid_request"),
    (b'"a string"', "invalid_request"),
    (b'{"id": "not-a-uuid", "prompt": "x"}', "invalid_request"),
    (b'{"id": 42, "prompt": "x"}', "invalid_request"),
    (b'{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "invalid_request"),
    (b"{}", "invalid_request"),
    (b'{"messages": []}', "invalid_request"),
    (b'{"messages": [{"role": "wizard", "content": "y"}]}', "invalid_request"),
    (b'{"messages": [{"role": "user"}]}', "invalid_request"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "invalid_request"),
    (b'{"messages": ["hi"]}', "invalid_request"),
    (b'{"prompt": 12}', "invalid_request"),
    (b'{"prompt": "x", "max_tokens": 0}', "invalid_request"),
    (b'{"prompt": "x", "max_tokens": -5}', "invalid_request"),
    (b'{"prompt": "x", "max_tokens": 10000000}', "invalid_request"),
    (b'{"prompt": "x", "max_tokens": 1.5}', "invalid_request"),
    (b'{"prompt": "x", "max_tokens": true}', "invalid_request"),
    (b'{"prompt": "x", "temperature": 3}', "invalid_request"),
    (b'{"prompt": "x", "temperature": "hot"}', "invalid_request"),
    (b'{"prompt": "x", "top_p": 1.5}', "invalid_request"),
    (b'{"prompt": "x", "seed": -1}', "invalid_request"),
    (b'{"prompt": "x", "stop": [1]}', "invalid_request"),
    (b'{"prompt": "x", "stop": ["a","b","c","d","e"]}', "invalid_request"),
    (b'{"prompt": "x", "stop": [""]}', "invalid_request"),
    (b'{"prompt": "x", "cancel_on_disconnect": "yes"}', "invalid_request"),
    (b'{"prompt": "x", "frobnicate": 1}', "invalid_request"),
    (b'{"prompt": "\\ud800"}', "invalid_request"),
    (b"\xff\xfe", "invalid_request"),
]


@pytest.fixture(scope="module")
def api(redis_server: RedisServer, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[httpx.Client]:
    """One consumer for the whole module: these requests change nothing another test here reads."""
    s = Stack(redis_server.url, demo_model, tmp_path_factory.mktemp("routes"))
    s.consumer("--max-body-bytes", "4096")
    with s.client() as client:
        yield client
    s.close()


@pytest.mark.parametrize(("body", "code"), BAD_CREATES)
def test_bad_create_bodies_get_400_json(api: httpx.Client, body: bytes, code: str) -> None:
    r = api.post("/v1/streams", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]


def test_body_too_large_gets_413(api: httpx.Client) -> None:
    r = api.post("/v1/streams", json={"prompt": "x" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        for _ in range(10):
            yield b"x" * 1000

    r = api.post("/v1/streams", content=chunks())
    assert r.status_code == 413


def test_unknown_ids_get_404_and_malformed_resume_ids_400(api: httpx.Client) -> None:
    unknown = str(uuid.uuid4())
    for method, path in [("GET", f"/v1/streams/{unknown}"), ("GET", f"/v1/streams/{unknown}/events"),
                         ("POST", f"/v1/streams/{unknown}/cancel"), ("GET", "/v1/streams/not-a-uuid"),
                         ("GET", "/v1/streams/not-a-uuid/events"), ("GET", "/nowhere")]:
        r = api.request(method, path)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["code"] == "not_found"
    sid = create(api).json()["id"]
    for bad in ["abc", "1-", "-1", "1-2-3", "99999999999999999999999-0", "1-0\r\nevil: x", " 1 -0"]:
        r = api.get(f"/v1/streams/{sid}/events", params={"last_event_id": bad})
        assert r.status_code == 400, bad
        assert r.json()["error"]["code"] == "invalid_request"
    r = api.get(f"/v1/streams/{sid}/events", headers={"Last-Event-ID": "nope"})
    assert r.status_code == 400
    r = api.put("/v1/streams")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_create_without_id_assigns_one_and_status_reports_it(api: httpx.Client) -> None:
    r = api.post("/v1/streams", json={"prompt": "hi"})
    assert r.status_code == 201
    body = r.json()
    assert uuid.UUID(body["id"]) and body["status"] == "queued" and body["created"] is True
    assert body["events_url"] == f"/v1/streams/{body['id']}/events"
    st = api.get(f"/v1/streams/{body['id']}").json()
    assert st["id"] == body["id"] and st["status"] == "queued" and st["model"] and st["created_at"].endswith("Z")
