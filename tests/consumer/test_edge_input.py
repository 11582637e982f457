"""Input that reaches past the guards (issue 23), on real consumers and a real redis-server: active content in
Durable Streams opened by URL in real chromium, digits that are not ASCII in every parser, read tokens no one
can forge from the keys file, the Host check of an open API (DNS rebinding), and /metrics behind a key."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import pytest
import redis
from helpers import eventually
from servers import Stack, needs_chromium

from broker.redis.server import RedisServer, free_port
from broker.settings import BrokerSettings
from broker.streams.keys import read_token_secret_key
from consumer.edge.auth import ApiKeys, new_key

if TYPE_CHECKING:
    from playwright.sync_api import Browser

pytestmark = pytest.mark.slow

# The consumers here never generate: no generator, and no model.
NO_MODEL = Path("/nonexistent/model.gguf")
METRICS_TOKEN = "prometheus-scrape-token-0123456789"
KEY_REFRESH_S = 1.0


class Consumers:
    """An open consumer and two keyed ones (no --read-token-secret) on one redis-server of this module."""

    def __init__(self, server: RedisServer, tmp: Path) -> None:
        self.redis = redis.Redis(port=server.port)
        self.token, entry = new_key("alice")
        self.keys_file = tmp / "keys.json"
        self.keys_file.write_bytes(orjson.dumps({"keys": [entry]}))
        self.auth = {"Authorization": f"Bearer {self.token}"}
        self.stack = Stack(server.url, NO_MODEL, tmp)
        _, self.open_url = self.stack.consumer("--ds-long-poll-timeout-s", "1", "--ds-sse-max-s", "1")
        keyed = ("--api-keys", str(self.keys_file), "--metrics-token", METRICS_TOKEN,
                 "--read-token-key-refresh-s", str(KEY_REFRESH_S))
        self.scrape_port = free_port()
        _, self.keyed_url = self.stack.consumer(*keyed, "--scrape-port", str(self.scrape_port))
        _, self.keyed_url_b = self.stack.consumer(*keyed)


@pytest.fixture(scope="module")
def consumers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Consumers]:
    server = RedisServer().start()
    c = Consumers(server, tmp_path_factory.mktemp("edge"))
    try:
        yield c
    finally:
        c.stack.close()
        c.redis.close()
        server.cleanup()


def error_code(r: httpx.Response) -> str:
    body = r.json()
    assert isinstance(body["error"]["message"], str), r.text
    return str(body["error"]["code"])


# -- 1. active content types never run from rsb's origin ------------------------------------------------

ACTIVE = {
    "text/html": b"<!doctype html><title>stream</title><p id=p>hello</p>"
                 b"<script>localStorage.setItem('ran', 'html'); document.title = 'ran';</script>",
    "image/svg+xml": b'<svg xmlns="http://www.w3.org/2000/svg"><script>localStorage.setItem("ran", "svg");'
                     b'document.title = "ran";</script><text y="20">hello</text></svg>',
    "application/xhtml+xml": b'<html xmlns="http://www.w3.org/1999/xhtml"><head><title>stream</title></head><body>'
                             b'<script>localStorage.setItem("ran", "xhtml"); document.title = "ran";</script>'
                             b'</body></html>',
}


def test_every_durable_streams_response_is_sandboxed_and_not_sniffed(consumers: Consumers) -> None:
    path = f"/v1/stream/active-{uuid.uuid4().hex}"
    with httpx.Client(base_url=consumers.open_url, timeout=10) as c:
        created = c.put(path, content=ACTIVE["text/html"], headers={"Content-Type": "text/html"})
        assert created.status_code == 201
        tail = created.headers["stream-next-offset"]
        responses = [created, c.get(path), c.head(path), c.get(path, params={"offset": "-1"}),
                     c.get(path, params={"offset": tail, "live": "long-poll"}),  # 204 after 1 s
                     c.post(path, content=b"<p>more</p>", headers={"Content-Type": "text/html"}),
                     c.get(path, params={"offset": "bad"}), c.get("/v1/stream/never-made")]
        with c.stream("GET", path, params={"offset": "-1", "live": "sse"}) as sse:
            responses.append(sse)
        assert [r.status_code for r in responses] == [201, 200, 200, 200, 204, 204, 400, 404, 200]
        for r in responses:
            assert r.headers["content-security-policy"] == "sandbox", (r.request.url, r.headers)
            assert r.headers["x-content-type-options"] == "nosniff"


@needs_chromium
def test_a_stream_holding_a_script_runs_nothing_when_opened_in_chromium(consumers: Consumers,
                                                                        browser: Browser) -> None:
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        page.goto(f"{consumers.open_url}/")  # the chat page's origin, whose storage the script would reach
        page.evaluate("localStorage.setItem('chat', 'mine')")
        with httpx.Client(base_url=consumers.open_url, timeout=10) as c:
            for ctype, body in ACTIVE.items():
                path = f"/v1/stream/active-{uuid.uuid4().hex}"
                assert c.put(path, content=body, headers={"Content-Type": ctype}).status_code == 201
                shown = page.goto(f"{consumers.open_url}{path}")
                assert shown is not None and shown.status == 200
                assert shown.headers["content-type"] == ctype  # served as written, but inert
                page.wait_for_timeout(200)
                assert page.title() != "ran", ctype
                # The document is an opaque origin: no storage of rsb's origin at all.
                assert page.evaluate("(() => { try { return String(localStorage.length) } catch (e) "
                                     "{ return e.name } })()") == "SecurityError", ctype
        page.goto(f"{consumers.open_url}/")
        assert page.evaluate("localStorage.getItem('ran')") is None
        assert page.evaluate("localStorage.getItem('chat')") == "mine"
    finally:
        ctx.close()


# -- 2. ASCII digits only ---------------------------------------------------------------------------------

ARABIC_ID = "١٢٣-٠"  # Arabic-Indic digits: str.isdigit() and re's \d accept them, Redis does not


def test_digits_that_are_not_ascii_are_refused_with_a_code(consumers: Consumers) -> None:
    with httpx.Client(base_url=consumers.open_url, timeout=10) as c:
        sid = str(uuid.uuid4())
        assert c.post("/v1/streams", json={"id": sid, "prompt": "x", "max_tokens": 4}).status_code == 201
        events = f"/v1/streams/{sid}/events"
        no_headers: dict[bytes, bytes] = {}
        for headers, params in (({b"Last-Event-ID": ARABIC_ID.encode()}, {}),
                                (no_headers, {"last_event_id": ARABIC_ID}),
                                (no_headers, {"last_event_id": "²-0"}),
                                (no_headers, {"last_event_id": "1" * 5000 + "-0"})):
            r = c.get(events, headers=headers, params=params)
            assert r.status_code == 400 and error_code(r) == "invalid_request", (headers, params, r.text)
        # A stream id spelled with other digits (or dashes elsewhere) names no stream: never an alias of one.
        alias = sid.replace("1", "١").replace("2", "٢") if any(d in sid for d in "12") else "١" + sid[1:]
        for spelled in (alias, sid.replace("-", "") + "----", "{" + sid[1:-1] + "}"):
            assert c.get(f"/v1/streams/{spelled}").status_code == 404, spelled
        assert c.post("/v1/streams", json={"id": alias, "prompt": "x"}).status_code == 400
        for params in ({"since": "²"}, {"until": "١٧٠٠٠٠٠٠٠٠"}, {"since": "9" * 5000}):
            r = c.get("/v1/reports/aborted", params=params)
            assert r.status_code == 400 and error_code(r) == "invalid_request", params

        path = f"/v1/stream/digits-{uuid.uuid4().hex}"
        assert c.put(path, content=b"x", headers={"Content-Type": "text/plain"}).status_code == 201
        arabic_offset = "٠" * 16 + "_" + "٠" * 16
        for params in ({"offset": arabic_offset}, {"offset": "²" + "0" * 15 + "_" + "0" * 16}):
            r = c.get(path, params=params)
            assert r.status_code == 400 and error_code(r) == "invalid_request", params
        # Cursors from a client that are not ASCII digits are ignored (a fresh cursor), never a 500.
        r = c.get(path, params={"offset": "-1", "live": "long-poll", "cursor": "١٢٣"})
        assert r.status_code == 200 and r.headers["stream-cursor"].isascii()
        for name, value in (("Stream-TTL", "١٠"), ("Stream-TTL", "²")):
            r = c.put(f"/v1/stream/digits-{uuid.uuid4().hex}", headers={name.encode(): value.encode()})
            assert r.status_code == 400 and error_code(r) == "invalid_request", (name, value)
        producer = {b"Producer-Id": b"p", b"Producer-Epoch": "١".encode(), b"Producer-Seq": b"0", b"Content-Type": b"text/plain"}
        r = c.post(path, content=b"y", headers=producer)
        assert r.status_code == 400 and error_code(r) == "invalid_request"

    with httpx.Client(base_url=consumers.keyed_url, timeout=10) as c:
        sid = str(uuid.uuid4())
        created = c.post("/v1/streams", json={"id": sid, "prompt": "x", "max_tokens": 4}, headers=consumers.auth)
        token = created.json()["read_token"]
        exp, key_id, sig = token.split(".")
        for bad in (f"{'²' * len(exp)}.{key_id}.{sig}", f"{exp.translate(str.maketrans('0123456789', '٠١٢٣٤٥٦٧٨٩'))}"
                    f".{key_id}.{sig}", f"{'9' * 5000}.{key_id}.{sig}"):
            r = c.get(f"/v1/streams/{sid}", params={"token": bad})
            assert r.status_code == 401 and error_code(r) == "unauthorized", bad
        assert c.get(f"/v1/streams/{sid}", params={"token": token}).status_code == 200


# -- 3. read tokens: a random secret in Redis, shared by the pods -------------------------------------------


def test_pods_share_a_random_read_token_secret_and_refuse_one_derived_from_the_keys_file(
        consumers: Consumers) -> None:
    sid = str(uuid.uuid4())
    with httpx.Client(base_url=consumers.keyed_url, timeout=10) as a, \
            httpx.Client(base_url=consumers.keyed_url_b, timeout=10) as b:
        token = a.post("/v1/streams", json={"id": sid, "prompt": "x", "max_tokens": 4},
                       headers=consumers.auth).json()["read_token"]
        # Any pod accepts any pod's token (EventSource reconnects land anywhere).
        assert b.get(f"/v1/streams/{sid}", params={"token": token}).status_code == 200
        assert a.get(f"/v1/streams/{sid}", params={"token": token}).status_code == 200
        with b.stream("GET", f"/v1/streams/{sid}/events", params={"token": token}) as r:
            assert r.status_code == 200
        # The secret is random, in Redis, once: not derived from anything the keys file holds.
        secret = consumers.redis.get(read_token_secret_key())
        assert isinstance(secret, bytes) and len(secret) == 64
        entry = orjson.loads(consumers.keys_file.read_bytes())["keys"][0]
        derived = hashlib.sha256(b"rsb-read-token|" + entry["id"].encode() + bytes.fromhex(entry["sha256"])).digest()
        exp = int(time.time()) + 600
        forged = f"{exp}.alice.{ApiKeys.sign(derived, uuid.UUID(sid), 'alice', exp)}"
        for c in (a, b):
            r = c.get(f"/v1/streams/{sid}", params={"token": forged})
            assert r.status_code == 401 and error_code(r) == "unauthorized"
        # The same signature with the stored secret is accepted: the forgery fails for its key alone.
        genuine = f"{exp}.alice.{ApiKeys.sign(secret, uuid.UUID(sid), 'alice', exp)}"
        assert b.get(f"/v1/streams/{sid}", params={"token": genuine}).status_code == 200


def test_a_rotated_read_token_key_reaches_every_pod_and_old_tokens_are_refused(consumers: Consumers) -> None:
    sid = str(uuid.uuid4())
    body = {"id": sid, "prompt": "x", "max_tokens": 4}
    # Token reads carry no Authorization header (as EventSource): clients of both pods without the key.
    with httpx.Client(base_url=consumers.keyed_url, timeout=10) as a, \
            httpx.Client(base_url=consumers.keyed_url_b, timeout=10) as b:
        old = a.post("/v1/streams", json=body, headers=consumers.auth).json()["read_token"]
        assert b.get(f"/v1/streams/{sid}", params={"token": old}).status_code == 200
        consumers.redis.delete(read_token_secret_key())  # the rotation docs/security.md gives

        def rotated() -> bool:
            for c in (a, b):
                r = c.get(f"/v1/streams/{sid}", params={"token": old})
                assert r.status_code == 401, "a token signed with the old key is still accepted"
            return True

        eventually(rotated, 10 * KEY_REFRESH_S, "the old key to be dropped by both pods")
        new_key_value = consumers.redis.get(read_token_secret_key())
        assert isinstance(new_key_value, bytes) and len(new_key_value) == 64  # made again, by one pod, for both
        fresh = b.post("/v1/streams", json=body, headers=consumers.auth)  # a retry: 200, a fresh token
        assert fresh.status_code == 200 and fresh.json()["read_token"] != old
        for c in (a, b):
            assert c.get(f"/v1/streams/{sid}", params={"token": fresh.json()["read_token"]}).status_code == 200


# -- 4. the Host check of an open API ----------------------------------------------------------------------


def test_an_open_api_answers_only_loopback_names_and_allowed_hosts(consumers: Consumers) -> None:
    port = consumers.open_url.rsplit(":", 1)[1]
    with httpx.Client(base_url=consumers.open_url, timeout=10) as c:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example",
                     "10.0.0.1", "[::2]"):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/streams"), ("GET", "/"),
                                 ("GET", f"/v1/streams/{uuid.uuid4()}/events"), ("GET", "/v1/stream/x"),
                                 ("GET", "/metrics")):
                r = c.request(method, path, headers={"Host": host})
                assert r.status_code == 421 and error_code(r) == "host_not_allowed", (host, path, r.text)
            assert c.get("/healthz", headers={"Host": host}).status_code == 200  # probes name the pod's address
        for host in ("localhost", f"localhost:{port}", "LOCALHOST.", f"127.0.0.1:{port}", f"[::1]:{port}", "[::1]"):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
    # Keys: no Host check (a rebinding page has no key).
    with httpx.Client(base_url=consumers.keyed_url, timeout=10) as c:
        assert c.get("/v1/models", headers={"Host": "evil.example", **consumers.auth}).status_code == 200


def test_allowed_hosts_names_more_hosts_or_any(consumers: Consumers) -> None:
    _, listed = consumers.stack.consumer("--allowed-hosts", "rsb.example.com, api.example.com:8443")
    _, anyhost = consumers.stack.consumer("--allowed-hosts", "*")
    with httpx.Client(base_url=listed, timeout=10) as c:
        for host in ("rsb.example.com", "RSB.example.com:443", "api.example.com", "localhost"):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
        assert c.get("/v1/models", headers={"Host": "other.example.com"}).status_code == 421
    with httpx.Client(base_url=anyhost, timeout=10) as c:
        assert c.get("/v1/models", headers={"Host": "anything.example"}).status_code == 200


# -- 5. /metrics behind a key --------------------------------------------------------------------------------


def test_metrics_need_a_key_when_keys_are_set(consumers: Consumers) -> None:
    with httpx.Client(base_url=consumers.keyed_url, timeout=10) as c:
        for headers in ({}, {"Authorization": "Bearer nobody.x"}, {"Authorization": f"Bearer {METRICS_TOKEN}x"},
                        {"Authorization": METRICS_TOKEN}):
            r = c.get("/metrics", headers=headers)
            assert r.status_code == 401 and error_code(r) == "unauthorized", headers
        for headers in (consumers.auth, {"Authorization": f"Bearer {METRICS_TOKEN}"}):
            r = c.get("/metrics", headers=headers)
            assert r.status_code == 200 and "rsb_queue_waiting" in r.text
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
    # Or on a port of its own, which serves nothing else (for Prometheus, which cannot send a key by annotation).
    scrape = f"http://127.0.0.1:{consumers.scrape_port}"
    r = httpx.get(f"{scrape}/metrics", timeout=10)
    assert r.status_code == 200 and "rsb_queue_waiting" in r.text and "rsb_connected_readers" in r.text
    assert httpx.get(f"{scrape}/v1/models", timeout=10).status_code == 404
    with httpx.Client(base_url=consumers.open_url, timeout=10) as c:
        assert c.get("/metrics").status_code == 200  # open mode: open, on loopback names only


# -- 6. a Redis password of its own (RSB_REDIS_PASSWORD, e.g. from a Kubernetes Secret) -----------------------


def test_the_redis_password_setting_reaches_a_redis_that_requires_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    server = RedisServer(password="s3cret/:@ pw").start()
    stack = Stack(f"redis://127.0.0.1:{server.port}/0", NO_MODEL, tmp_path)
    try:
        plain = BrokerSettings(redis_url=f"redis://127.0.0.1:{server.port}/0")
        assert BrokerSettings(redis_url=plain.redis_url, redis_password="s3cret/:@ pw").url == server.url
        # The URL's own password wins over the setting.
        assert BrokerSettings(redis_url=server.url, redis_password="other").url == server.url
        with monkeypatch.context() as m:
            m.setenv("RSB_REDIS_PASSWORD", "s3cret/:@ pw")
            _, url = stack.consumer()
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        _, refused = stack.consumer()  # no password: Redis refuses it, the pod is not ready
        r = httpx.get(f"{refused}/readyz", timeout=10)
        assert r.status_code >= 500 and error_code(r)
    finally:
        stack.close()
        server.cleanup()


# -- 7. leftovers of issue 42: each a 4xx with a code, never a 500 ------------------------------------------------

U64_MAX = 2**64 - 1


def test_resuming_after_the_largest_event_id_is_a_400(consumers: Consumers) -> None:
    """No event can follow ``<u64 max>-<u64 max>``, and Redis refuses a range after it: that was a 500."""
    with httpx.Client(base_url=consumers.open_url, timeout=10) as c:
        sid = str(uuid.uuid4())
        assert c.post("/v1/streams", json={"id": sid, "prompt": "x", "max_tokens": 4}).status_code == 201
        r = c.get(f"/v1/stream/rsb/{sid}", params={"offset": f"{U64_MAX:016d}_{U64_MAX:016d}"})
        assert r.status_code == 400 and error_code(r) == "invalid_request", r.text
        for headers, params in (({"Last-Event-ID": f"{U64_MAX}-{U64_MAX}"}, {}),
                                ({}, {"last_event_id": f"{U64_MAX}-{U64_MAX}"})):
            r = c.get(f"/v1/streams/{sid}/events", headers=headers, params=params)
            assert r.status_code == 400 and error_code(r) == "invalid_request", r.text
        # One below it is an ordinary resume point past the end: nothing yet, the stream goes on.
        r = c.get(f"/v1/stream/rsb/{sid}", params={"offset": f"{U64_MAX:016d}_{U64_MAX - 1:016d}"})
        assert r.status_code == 200 and r.json() == [], r.text


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_a_body_nested_a_thousand_deep_is_a_400_on_every_create_route(consumers: Consumers) -> None:
    """A tool's ``parameters.examples`` or ``default`` nested 1,000 deep was a 500 (the body is written back as JSON,
    which stops at 254 levels); ``response_format`` got its 400 from the schema check."""
    deep = _nested(1000)
    tool: dict[str, Any] = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                      "properties": {}}}}
    with httpx.Client(base_url=consumers.open_url, timeout=10) as c:
        for where in ("examples", "default"):
            t = {**tool, "function": {**tool["function"], "parameters": {"type": "object", "properties": {},
                                                                          where: deep}}}
            msgs = [{"role": "user", "content": "hi"}]
            for path, body in (("/v1/streams", {"messages": msgs, "tools": [t]}),
                               ("/v1/chat/completions", {"model": "m", "messages": msgs, "tools": [t]}),
                               ("/v1/responses", {"model": "m", "input": "hi", "tools": [{"type": "function",
                                                  "name": "f", "parameters": t["function"]["parameters"]}]}),
                               ("/api/chat", {"id": "c1", "messages": [], "tools": [t]})):
                r = c.post(path, content=_dumps(body), headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (path, where, r.status_code, r.text[:300])


def _dumps(value: object) -> bytes:
    """JSON of any depth (orjson, like rsb, writes at most 254 levels)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        return json.dumps(value).encode()
    finally:
        sys.setrecursionlimit(limit)


def test_a_key_named_dash_is_refused_at_start(tmp_path: Path, consumers: Consumers) -> None:
    """'-' is the keyless caller's name in Redis's keys (its usage log, budgets, Durable Streams, conversations): a key
    named so read an open deployment's usage."""
    _, entry = new_key("alice")
    keys = tmp_path / "dash.json"
    keys.write_bytes(orjson.dumps({"keys": [{**entry, "id": "-"}]}))
    with pytest.raises(ValueError, match="start with a letter"):
        ApiKeys.load(keys)
    r = subprocess.run([sys.executable, "-m", "rsb", "consumer", "--redis-url", "redis://127.0.0.1:9/0",
                        "--api-keys", str(keys), "--port", str(free_port())], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "start with a letter" in r.stderr, r.stderr
