"""A property over every route: Unicode text in its path parameters, query parameters and headers never makes a
500, never hangs, and every 4xx is a JSON error with a code. Real consumers (open and keyed) on a real
redis-server, an httpx client; digits of every script, lookalikes of the ids rsb issues and plain text."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from servers import Stack

from broker.redis.server import RedisServer
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow

NO_MODEL = Path("/nonexistent/model.gguf")
# The response head must come within this (a 200 SSE or long-poll body may then stay open: it is closed at once).
HEAD_TIMEOUT_S = 10.0


class Targets:
    def __init__(self, server: RedisServer, tmp: Path) -> None:
        token, entry = new_key("fuzz")
        keys = tmp / "keys.json"
        keys.write_bytes(orjson.dumps({"keys": [entry]}))
        self.auth = f"Bearer {token}"
        self.stack = Stack(server.url, NO_MODEL, tmp)
        _, self.open_url = self.stack.consumer("--ds-long-poll-timeout-s", "1", "--ds-sse-max-s", "1")
        _, self.keyed_url = self.stack.consumer("--api-keys", str(keys), "--ds-long-poll-timeout-s", "1")
        # Things that exist, so the fuzz also reaches the parsers behind "no such stream".
        with httpx.Client(base_url=self.open_url, timeout=10) as c:
            self.stream_id = str(uuid.uuid4())
            assert c.post("/v1/streams", json={"id": self.stream_id, "prompt": "x", "max_tokens": 4}).status_code == 201
            self.event_id = c.get(f"/v1/stream/rsb/{self.stream_id}").headers.get("stream-next-offset", "")
            self.ds_path = f"fuzz-{uuid.uuid4().hex}"
            r = c.put(f"/v1/stream/{self.ds_path}", content=b"hello", headers={"Content-Type": "text/plain"})
            self.ds_offset = r.headers["stream-next-offset"]
        # One client per consumer for every example (a connection is reused until a response closes it).
        self.clients = {url: httpx.Client(timeout=httpx.Timeout(HEAD_TIMEOUT_S)) for url in (self.open_url,
                                                                                            self.keyed_url)}
        with httpx.Client(base_url=self.keyed_url, timeout=10) as c:
            created = c.post("/v1/streams", json={"id": str(uuid.uuid4()), "prompt": "x", "max_tokens": 4},
                             headers={"Authorization": self.auth}).json()
            self.read_token = created["read_token"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    server = RedisServer().start()
    t = Targets(server, tmp_path_factory.mktemp("fuzz"))
    try:
        yield t
    finally:
        for client in t.clients.values():
            client.close()
        t.stack.close()
        server.cleanup()


# Every route, with its path parameters as {}.
ROUTES = [
    ("GET", "/v1/streams/{}/events"), ("GET", "/v1/streams/{}"), ("POST", "/v1/streams/{}/cancel"),
    ("POST", "/v1/streams"), ("GET", "/v1/reports/aborted"), ("GET", "/v1/conversations/{}/turns"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"), ("GET", "/v1/responses/{}"),
    ("POST", "/v1/responses/{}/cancel"), ("POST", "/v1/conversations"), ("GET", "/v1/conversations/{}"),
    ("DELETE", "/v1/conversations/{}"), ("GET", "/v1/conversations/{}/items"),
    ("GET", "/v1/conversations/{}/items/{}"), ("GET", "/v1/models"), ("GET", "/v1/models/{}"),
    ("GET", "/v1/stream/{}"), ("HEAD", "/v1/stream/{}"), ("PUT", "/v1/stream/{}"), ("POST", "/v1/stream/{}"),
    ("DELETE", "/v1/stream/{}"), ("OPTIONS", "/v1/stream/{}"), ("GET", "/v1/stream/rsb/{}"),
    ("POST", "/api/chat"), ("GET", "/api/chat/{}/stream"), ("POST", "/api/chat/{}/stop"),
    ("GET", "/api/chat/{}/messages"), ("GET", "/metrics"), ("GET", "/healthz"), ("GET", "/readyz"),
    ("GET", "/openapi.json"), ("GET", "/"), ("GET", "/static/app.js"), ("GET", "/static/{}"),
]
QUERY_NAMES = ["last_event_id", "token", "since", "until", "group_by", "offset", "live", "cursor", "limit",
               "after", "order", "starting_after", "stream", "include"]
HEADER_NAMES = ["Last-Event-ID", "Authorization", "Content-Type", "Stream-TTL", "Stream-Expires-At", "Stream-Seq",
                "Stream-Closed", "Stream-Forked-From", "Stream-Fork-Offset", "Stream-Fork-Sub-Offset", "Producer-Id",
                "Producer-Epoch", "Producer-Seq", "If-None-Match", "Idempotency-Key", "X-Forwarded-For", "Host",
                "Origin", "Accept", "Range", "Content-Length"]
# Digits of other scripts (Arabic-Indic, Devanagari, fullwidth, mathematical), super/subscripts, and separators.
DIGITS = "0123456789١٢٣٤٥٦٧٨٩٠०१२३४५६७८९０１２３𝟎𝟏𝟗²³¹⁰₀½-_.:+ "


@st.composite
def lookalikes(draw: st.DrawFn, t: Targets) -> str:
    """An id rsb issued with some characters swapped for other digits, or plain Unicode text."""
    base = draw(st.sampled_from([t.stream_id, t.event_id, t.ds_path, t.ds_offset, t.read_token, "1700000000",
                                 f"resp_{uuid.UUID(t.stream_id).hex}", f"conv_{uuid.UUID(t.stream_id).hex}"]))
    chars = list(base)
    for _ in range(draw(st.integers(0, 3))):
        if chars:
            chars[draw(st.integers(0, len(chars) - 1))] = draw(st.sampled_from(DIGITS))
    return "".join(chars)


def values(t: Targets) -> st.SearchStrategy[str]:
    return st.one_of(lookalikes(t), st.text(alphabet=DIGITS, max_size=24), st.text(max_size=24),
                     st.sampled_from(["9" * 5000, "-1", "now", "sse", "long-poll", "true", ""]))


def header_value(raw: str) -> bytes:
    # CR, LF and NUL would end or break the header itself; UTF-8 bytes otherwise (h11 refuses to send some others).
    return raw.translate({0: None, 10: None, 13: None}).strip().encode()


@st.composite
def requests(draw: st.DrawFn, t: Targets) -> tuple[str, str, str, dict[str, str], list[tuple[bytes, bytes]]]:
    method, template = draw(st.sampled_from(ROUTES))
    path = template.format(*(quote(draw(values(t)), safe="") or "x" for _ in range(template.count("{}"))))
    base = draw(st.sampled_from([t.open_url, t.keyed_url]))
    query = draw(st.dictionaries(st.sampled_from(QUERY_NAMES), values(t), max_size=3))
    headers = [(name.lower().encode(), header_value(draw(values(t))))
               for name in draw(st.lists(st.sampled_from(HEADER_NAMES), max_size=3, unique=True))]
    if base == t.keyed_url and draw(st.booleans()) and not any(n == b"authorization" for n, _ in headers):
        headers.append((b"authorization", t.auth.encode()))
    return base, method, path, query, headers


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_unicode_in_every_parameter_and_header_is_never_a_500_or_a_hang(targets: Targets, data: st.DataObject) -> None:
    base, method, path, query, headers = data.draw(requests(targets))
    if any(n == b"content-length" for n, _ in headers):  # the client must not lie about its own body
        headers = [(n, v) for n, v in headers if n != b"content-length"]
        headers.append((b"content-length", b"0"))
    c = targets.clients[base]
    request = c.build_request(method, base + path, params=query, headers=headers)
    try:
        r = c.send(request, stream=True)
    except httpx.LocalProtocolError:
        reject()  # a header value h11 will not put on the wire (most C0 controls): no client can send it either
    except httpx.TimeoutException:
        pytest.fail(f"no response head in {HEAD_TIMEOUT_S} s: {method} {request.url} {headers}")
    try:
        ctype = r.headers.get("content-type", "")
        assert r.status_code < 500, (method, str(request.url), headers, r.status_code)
        if 400 <= r.status_code < 500 and method != "HEAD":
            body = orjson.loads(r.read())
            assert isinstance(body["error"]["code"], str) and body["error"]["code"], (method, request.url, body)
            assert ctype.startswith("application/json"), ctype
    finally:
        r.close()
