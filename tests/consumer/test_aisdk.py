"""The Vercel AI SDK view (consumer/views/aisdk) driven by the real client: the ``ai`` package's own
``AbstractChat`` + ``DefaultChatTransport``, ai@5, ai@6 and ai@7 (tests/aisdk/harness, pinned in its
package-lock.json, installed by scripts/test.sh with ``npm ci``; ai@7 runs on the harness's own Node 22, the
npm package ``node``), in Node and (ai@5, ai@6) in Debian's chromium, against
real redis-server, `rsb generator` (llama.cpp, the slow demo model) and `rsb consumer` processes with two
API keys. The harness returns what the chat shows; every answer is compared with its rsb stream, read
natively (the assistant message's id is the stream id)."""

from __future__ import annotations

import functools
import itertools
import json
import os
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from aisdk_harness import HARNESS, NODE, NODE22, require_harness
from helpers import read_sse
from scripted_upstream import Reply, ScriptedUpstream, reasoning, text, tool_call_pieces
from servers import CHROMIUM, Stack, StackFactory, needs_chromium

from broker.redis.server import RedisServer
from broker.sse import ByteDecoder, parse_block
from broker.streams.keys import StreamKeys
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow

MAJORS = ("ai5", "ai6")  # in Chromium (ai@7's build is not mapped for a page without a bundler)
NODE_MAJORS = ("ai5", "ai6", "ai7")
# Long enough that a stop, a drop or a second tab lands mid-answer on the slow model; short answers where
# the scenario only needs an answer.
LONG, SHORT = 600, 30

needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed (Node 20: apt-get install nodejs npm); "
                                "the AI SDK harness runs the real `ai` package")

if CHROMIUM is not None:
    from playwright.sync_api import Browser


class AisdkStack:
    """rsb with two API keys: a consumer (and the keys to call it with) and one generator on the slow model,
    whose cancel_on_disconnect grace is short so that a stop by disconnect shows within a test."""

    def __init__(self, stack: Stack, tmp: Path, slow_model: Path, cors_origin: str | None = None,
                 upstream: str | None = None) -> None:
        self.key_a, entry_a = new_key("alice")
        self.key_b, entry_b = new_key("bob")
        keys = tmp / "keys.json"
        keys.write_bytes(orjson.dumps({"keys": [entry_a, entry_b]}))
        self.redis_url = stack.redis_url
        engine = ("--upstream", upstream) if upstream else ()
        stack.generator("--lease-s", "1", "--disconnect-grace-s", "1", *engine, model=slow_model,
                        ignore_eos=upstream is None)
        cors = ("--cors-origins", cors_origin) if cors_origin else ()
        _, self.url = stack.consumer("--api-keys", str(keys), "--heartbeat-s", "1", *cors)

    def native(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {key or self.key_a}"})


AisdkStackFactory = Callable[..., AisdkStack]


@pytest.fixture
def aisdk_stack(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
                slow_model: Path, tmp_path: Path) -> AisdkStackFactory:
    return functools.partial(AisdkStack, stack_factory(redis_server.url), tmp_path, slow_model)


# -- what each scenario must show (scenarios.mjs returns it; the same checks for Node and Chromium) -------


class Streams:
    """The native view of the answers: each assistant message's rsb stream, read to its end."""

    def __init__(self, rsb: AisdkStack) -> None:
        self.rsb = rsb

    def read(self, message_id: str, key: str | None = None) -> tuple[str, dict[str, Any]]:
        """(the stream's whole text, its terminal event's data plus ``type``)."""
        uuid.UUID(message_id)  # the message id is the stream id
        with self.rsb.native(key) as c:
            read = read_sse(c, f"/v1/streams/{message_id}/events")
        assert read.status == 200, (message_id, read.status)
        last = read.events[-1]
        return read.text, {**last.data, "type": last.event}

    def text(self, message_id: str, key: str | None = None) -> str:
        return self.read(message_id, key)[0]

    def engine_messages(self, message_id: str) -> list[dict[str, Any]]:
        """The messages the engine was given for an answer: its stream's request as stored at create."""
        r = redis.Redis.from_url(self.rsb.redis_url)
        try:
            raw = r.hget(StreamKeys.of(uuid.UUID(message_id), 1).meta, "req")
        finally:
            r.close()
        assert isinstance(raw, bytes), message_id
        return list(orjson.loads(raw)["messages"])


def _requests(chat: dict[str, Any]) -> list[tuple[str, str, int]]:
    return [(r["method"], r["path"], r["status"]) for r in chat["requests"]]


def check_send(r: dict[str, Any], s: Streams, major: str) -> None:
    chat = r["chat"]
    text, end = s.read(chat["messageId"])
    assert chat["status"] == "ready" and chat["error"] is None
    assert chat["roles"] == ["user", "assistant"]
    assert chat["text"] == text and len(text) > 0
    assert chat["partTypes"] == ["step-start", "text"]
    assert end["type"] == "done"
    meta = chat["metadata"]
    assert meta["status"] == "done" and meta["model"].startswith("rsb-demo")
    assert meta["usage"]["outputTokens"] == SHORT == end["usage"]["completion_tokens"]
    assert meta["usage"]["totalTokens"] == meta["usage"]["inputTokens"] + SHORT
    assert chat["finishes"][-1]["finishReason"] == "length" == meta["finishReason"]
    assert "data-rsb-queued" in chat["data"]  # rsb's own events reach onData, never the message
    assert sorted(r["body"]) == ["id", "max_tokens", "messages", "trigger"]
    assert _requests(chat) == [("POST", "/api/chat", 200)]


def check_abortResume(r: dict[str, Any], s: Streams, major: str) -> None:
    partial, final = r["partial"], r["final"]
    assert partial["status"] == "ready" and partial["finishes"][-1]["isAbort"] is True
    text, end = s.read(final["messageId"])
    assert 0 < len(partial["text"]) < len(text) and text.startswith(partial["text"])
    # stop() only closed the connection: the generation went on, and the replay landed exactly once.
    assert end["type"] == "done" and end["usage"]["completion_tokens"] == LONG
    assert final["assistants"] == 1 and final["textParts"] == 1 and final["text"] == text
    assert final["messageId"] == partial["messageId"] and final["status"] == "ready"
    assert _requests(final) == [("POST", "/api/chat", 200), ("GET", f"/api/chat/{_chat_id(final)}/stream", 200)]


def _chat_id(chat: dict[str, Any]) -> str:
    return str(chat["requests"][-1]["path"]).split("/")[3]


def check_reloadWhileActive(r: dict[str, Any], s: Streams, major: str) -> None:
    partial, reloaded = r["partial"], r["reloaded"]
    text = s.text(reloaded["messageId"])
    assert reloaded["messageId"] == partial["messageId"]
    assert reloaded["roles"] == ["user", "assistant"] and reloaded["text"] == text
    assert [q[2] for q in _requests(reloaded)] == [200]


def check_reloadAfterFinish(r: dict[str, Any], s: Streams, major: str) -> None:
    assert r["first"]["text"] == s.text(r["first"]["messageId"])
    assert r["unchanged"] is True and r["persisted"]["status"] == "ready"
    assert _requests(r["persisted"])[-1][2] == 204
    assert r["empty"]["roles"] == [] and r["empty"]["status"] == "ready"
    assert [q[2] for q in _requests(r["empty"])] == [204]


def check_networkDrop(r: dict[str, Any], s: Streams, major: str) -> None:
    dropped, final = r["dropped"], r["final"]
    assert dropped["finishes"][-1]["isDisconnect"] is True and dropped["status"] == "error"
    text = s.text(final["messageId"])
    assert final["assistants"] == 1 and final["status"] == "ready"
    if major != "ai5":
        # resumeStreamIsReplay: the kept partial state is reset at the replay's `start`.
        assert final["text"] == text and final["textParts"] == 1
    else:
        # ai@5 appends the replay to the partial state it kept (fixed in ai 6.0.304, not backported): the
        # documented reason for the workaround below, or for ai@6.
        assert final["textParts"] == 2 and final["text"] == dropped["text"] + text


def check_networkDropWorkaround(r: dict[str, Any], s: Streams, major: str) -> None:
    dropped, final = r["dropped"], r["final"]
    assert dropped["finishes"][-1]["isDisconnect"] is False and dropped["status"] == "error"
    assert final["assistants"] == 1 and final["textParts"] == 1
    assert final["text"] == s.text(final["messageId"])


def check_stopEndpoint(r: dict[str, Any], s: Streams, major: str) -> None:
    chat = r["chat"]
    assert r["stop"]["status"] == 202 and r["stop"]["json"]["messageId"] == chat["messageId"]
    text, end = s.read(chat["messageId"])
    # The worker stopped: cancelled by the client, fewer tokens than asked for (5 * LONG: scenarios.mjs).
    assert end["type"] == "cancelled" and end["reason"] == "client"
    assert end["usage"]["completion_tokens"] < 5 * LONG
    # The open stream ended by itself: every token generated before the stop, then `abort`.
    assert chat["status"] == "ready" and chat["error"] is None and chat["text"] == text
    assert chat["metadata"]["status"] == "cancelled" and chat["metadata"]["reason"] == "client"
    assert chat["finishes"][-1].get("finishReason") is None
    assert r["again"]["status"] == 202 and r["again"]["json"]["status"] == "cancelled"  # idempotent
    assert _requests(r["afterResume"])[-1][2] == 204 and r["afterResume"]["text"] == text


def check_stopCancelOnDisconnect(r: dict[str, Any], s: Streams, major: str) -> None:
    chat = r["chat"]
    assert chat["finishes"][-1]["isAbort"] is True
    text, end = s.read(chat["messageId"])
    assert r["native"]["json"]["status"] == "cancelled"
    assert end["type"] == "cancelled" and end["reason"] == "disconnect"
    assert end["usage"]["completion_tokens"] < 5 * LONG
    assert text.startswith(chat["text"])
    assert _requests(r["afterResume"])[-1][2] == 204


def check_parallel(r: dict[str, Any], s: Streams, major: str) -> None:
    a, b = r["a"], r["b"]
    assert a["messageId"] != b["messageId"]
    for chat in (a, b):
        assert chat["status"] == "ready" and chat["text"] == s.text(chat["messageId"])


def check_tenantIsolation(r: dict[str, Any], s: Streams, major: str) -> None:
    owner, other = r["owner"], r["otherResume"]
    # The other key sees no turn (204, as for a chat that never existed), cannot stop it, cannot read it.
    assert other["roles"] == [] and other["status"] == "ready" and [q[2] for q in _requests(other)] == [204]
    for answer in (r["otherStop"], r["otherStatus"], r["otherEvents"]):
        assert answer["status"] == 404 and answer["json"]["error"]["code"] == "not_found"
    assert r["stranger"]["status"] == "error" and [q[2] for q in _requests(r["stranger"])] == [401]
    assert owner["text"] == s.text(owner["messageId"])
    # Its own message in the same chat id is its own turn.
    mine = r["otherSend"]
    assert mine["messageId"] != owner["messageId"]
    assert mine["text"] == s.text(mine["messageId"], s.rsb.key_b)
    with s.rsb.native() as c:
        assert c.get(f"/v1/streams/{mine['messageId']}").status_code == 404


def check_repost(r: dict[str, Any], s: Streams, major: str) -> None:
    chat, again = r["chat"], r["again"]
    text = s.text(chat["messageId"])
    assert again["status"] == 200 and again["messageId"] == chat["messageId"]  # the same turn: one generation
    assert again["text"] == chat["text"] == text
    assert again["last"] == ["finish-step", "finish", "[DONE]"]


def check_regenerate(r: dict[str, Any], s: Streams, major: str) -> None:
    ids, bodies = r["ids"], r["bodies"]
    assert bodies[1] == bodies[2] and bodies[1]["trigger"] == "regenerate-message"
    assert len(set(ids)) == 3  # identical regenerate bodies, each a new turn once the last one ended
    assert r["chat"]["assistants"] == 1 and r["chat"]["messageId"] == ids[-1]
    assert r["texts"] == [s.text(i) for i in ids]


def check_multiTab(r: dict[str, Any], s: Streams, major: str) -> None:
    first, second = r["first"], r["second"]
    assert first["messageId"] == second["messageId"]
    assert first["text"] == second["text"] == s.text(first["messageId"])
    assert [q[2] for q in _requests(second)] == [200]


def check_secondDevice(r: dict[str, Any], s: Streams, major: str) -> None:
    a, running, followed = r["a"], r["whileRunning"], r["followed"]
    first_answer = s.text(a["messageId"])
    # While the phone's turn ran, the laptop got its question, then followed the answer into the same message.
    assert running["active"] is True and [m["role"] for m in running["messages"]] == ["user"]
    assert running["messages"][0]["parts"] == [{"type": "text", "text": "from the phone"}]
    assert followed["messageId"] == a["messageId"] and followed["text"] == first_answer == a["text"]
    assert [q[2] for q in _requests(followed)] == [200]
    # The laptop's turn: it sent the whole chat as the SDK does; the engine got the server's history.
    assert r["sent"]["roles"] == ["user", "assistant", "user", "assistant"] and r["sent"]["status"] == "ready"
    assert [m["role"] for m in r["bBodies"][0]["messages"]] == ["user", "assistant", "user"]
    second_answer = s.text(r["afterB"]["messages"][3]["id"])
    assert s.engine_messages(r["afterB"]["messages"][3]["id"]) == [
        {"role": "user", "content": "from the phone"}, {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "from the laptop"}]
    assert [(m["role"], m["parts"][-1]["text"]) for m in r["afterB"]["messages"]] == [
        ("user", "from the phone"), ("assistant", first_answer), ("user", "from the laptop"),
        ("assistant", second_answer)]
    assert r["reloadedRoles"] == ["user", "assistant", "user", "assistant"]
    # Both at once: one turn, one 409 (shown as the chat's error); the winner's was stopped after (scenarios.mjs).
    laptop = r["laptop"]
    statuses = sorted([r["reloaded"]["status"], laptop["status"]])
    assert statuses == ["error", "ready"], (r["reloaded"], laptop)
    loser, winner = (r["reloaded"], laptop) if r["reloaded"]["status"] == "error" else (laptop, r["reloaded"])
    assert loser["requests"][-1]["status"] == 409 and "running" in (loser["error"] or "")
    assert r["stop"]["status"] == 202 and r["stop"]["json"]["messageId"] == winner["messageId"]
    # The winner's answer, stopped mid-way (scenarios.mjs waits for its text), is the chat's last message.
    winner_text = s.text(winner["messageId"])
    assert winner["text"] == winner_text and len(winner_text) > 0
    final = r["final"]["messages"]
    assert r["final"]["active"] is False and [m["role"] for m in final] == ["user", "assistant"] * 3
    asked = "phone, at once" if winner is r["reloaded"] else "laptop, at once"
    assert final[4]["parts"][-1]["text"] == asked
    assert final[5]["id"] == winner["messageId"] and final[5]["parts"][-1]["text"] == winner_text
    assert r["other"]["status"] == 404  # another key has no chat of this id


CHECKS: dict[str, Callable[[dict[str, Any], Streams, str], None]] = {
    "send": check_send, "abortResume": check_abortResume, "reloadWhileActive": check_reloadWhileActive,
    "reloadAfterFinish": check_reloadAfterFinish, "networkDrop": check_networkDrop,
    "networkDropWorkaround": check_networkDropWorkaround, "stopEndpoint": check_stopEndpoint,
    "stopCancelOnDisconnect": check_stopCancelOnDisconnect, "parallel": check_parallel,
    "tenantIsolation": check_tenantIsolation, "repost": check_repost, "regenerate": check_regenerate,
    "multiTab": check_multiTab, "secondDevice": check_secondDevice,
}
# In Chromium: the flows a page goes through, over CORS (the page's origin is not rsb's).
BROWSER_SCENARIOS = ("send", "abortResume", "reloadWhileActive", "stopEndpoint", "parallel", "tenantIsolation")


def check_results(results: dict[str, Any], rsb: AisdkStack, major: str, scenarios: tuple[str, ...]) -> None:
    assert sorted(results) == sorted(scenarios)
    failed = {name: r["exception"] for name, r in results.items() if "exception" in r}
    assert not failed, f"scenarios raised: {json.dumps(failed, indent=1)}"
    streams = Streams(rsb)
    for name in scenarios:
        try:
            CHECKS[name](results[name], streams, major)
        except AssertionError as e:
            raise AssertionError(f"{major} {name}: {e}\n{json.dumps(results[name], indent=1)[:6000]}") from None


# -- the harness in Node ---------------------------------------------------------------------------------


def run_harness(major: str, rsb: AisdkStack, out: Path, scenarios: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``node run.mjs`` (Node 22 for ai@7) against ``rsb``; its report."""
    env = {**os.environ, "RSB_URL": rsb.url, "RSB_KEY_A": rsb.key_a, "RSB_KEY_B": rsb.key_b,
           "RSB_LONG_TOKENS": str(LONG), "RSB_SHORT_TOKENS": str(SHORT)}
    if scenarios is not None:
        env["RSB_SCENARIOS"] = ",".join(scenarios)
    node = str(NODE22) if major == "ai7" else NODE
    assert node is not None
    run = subprocess.run([node, "run.mjs", major, str(out)], cwd=HARNESS, env=env, capture_output=True, text=True,
                         timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["version"].startswith(f"{major[2:]}.")
    assert report["node"].startswith("v22." if major == "ai7" else "v")
    return report


@needs_node
@pytest.mark.timeout(300)
@pytest.mark.parametrize("major", NODE_MAJORS)
def test_use_chat_works_against_rsb(major: str, aisdk_stack: AisdkStackFactory, tmp_path: Path) -> None:
    require_harness()
    rsb = aisdk_stack()
    report = run_harness(major, rsb, tmp_path / f"{major}.json")
    check_results(report["results"], rsb, major, tuple(CHECKS))


# -- the same flows in Chromium, the `ai` package loaded as ES modules through an import map ---------------


class HarnessFiles(SimpleHTTPRequestHandler):
    """The page's own origin (test-only): the harness page with its import map, the scenario modules and
    the node_modules files the map names. Nothing of this ships with rsb."""

    import_maps: dict[str, str] = {}
    extensions_map = {**SimpleHTTPRequestHandler.extensions_map, ".js": "text/javascript",
                      ".mjs": "text/javascript"}
    _SERVED = ("/node_modules/", "/browser/shims/", "/chat.mjs", "/scenarios.mjs", "/joiners.mjs")

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path == "/page.html":
            major = dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("v", "")
            page = (HARNESS / "browser" / "page.html").read_text().replace("<!--IMPORTMAP-->", self.import_maps[major])
            body = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif path.startswith(self._SERVED) and ".." not in path:
            super().do_GET()
        else:
            self.send_error(404)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def harness_origin() -> Iterator[str]:
    """Serves the harness page and its modules on a free port; the base URL."""
    require_harness()
    maps = {}
    assert NODE is not None
    for major in MAJORS:
        built = json.loads(subprocess.run([NODE, "browser/importmap.mjs", major], cwd=HARNESS, check=True,
                                          capture_output=True, text=True, timeout=60).stdout)
        assert not built["problems"], built["problems"]
        maps[major] = f'<script type="importmap">{json.dumps({"imports": built["imports"]})}</script>'
    handler = type("Files", (HarnessFiles,), {"import_maps": maps})
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(HARNESS)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@needs_node
@needs_chromium
@pytest.mark.timeout(300)
@pytest.mark.parametrize("major", MAJORS)
def test_use_chat_works_in_chromium_without_a_bundler(major: str, aisdk_stack: AisdkStackFactory,
                                                     harness_origin: str, browser: Browser) -> None:
    require_harness()
    rsb = aisdk_stack(cors_origin=harness_origin)  # the page talks to rsb across origins: CORS for real
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        query = (f"v={major}&api={rsb.url}&a={rsb.key_a}&b={rsb.key_b}&long={LONG}&short={SHORT}"
                 f"&only={','.join(BROWSER_SCENARIOS)}")
        page.goto(f"{harness_origin}/page.html?{query}")
        page.wait_for_function("() => window.rsbResults !== undefined", timeout=240_000)
        report = page.evaluate("() => window.rsbResults")
    finally:
        ctx.close()
    assert not errors, errors
    assert "exception" not in report, report["exception"]
    assert "Chrome/" in report["userAgent"]
    check_results(report["results"], rsb, major, BROWSER_SCENARIOS)


# -- the wire, without node: what the harness cannot provoke ----------------------------------------------


def ui_chunks(response: httpx.Response) -> Iterator[Any]:
    """The chunks of a UI message stream as they arrive (``"[DONE]"`` as the string); comments skipped."""
    decoder = ByteDecoder()
    for raw in response.iter_raw():
        for block in decoder.feed(raw):
            parsed = parse_block(block)
            if parsed.is_event:
                assert [name for name, _ in parsed.fields] == ["data"], block  # data lines only
                yield parsed.data if parsed.data == "[DONE]" else json.loads(parsed.data)


def _turn_body(chat_id: str, text: str = "hi", **options: Any) -> dict[str, Any]:
    return {"id": chat_id, "trigger": "submit-message",
            "messages": [{"id": f"u-{chat_id}", "role": "user", "parts": [{"type": "text", "text": text}]}],
            **options}


REFUSED = [
    (b"{", "body is not valid JSON"),
    (b'{"messages": []}', "'id' (the chat id) must be a string"),
    (orjson.dumps({**_turn_body("c"), "trigger": "resume"}), "'trigger' must be"),
    (orjson.dumps({**_turn_body("c"), "messages": []}), "'messages' must be a non-empty list"),
    (orjson.dumps({**_turn_body("c"), "webSearch": True}), "unknown field(s): webSearch"),
    (orjson.dumps({**_turn_body("c"), "max_tokens": 0}), "'max_tokens' must be an integer"),
    (orjson.dumps(_turn_body("c") | {"messages": [{"role": "user", "parts": [
        {"type": "file", "mediaType": "image/png", "url": "data:,"}]}]}), "'file' parts are not supported"),
    (orjson.dumps(_turn_body("c") | {"messages": [{"role": "tool", "parts": []}]}), "messages[0] must be"),
    # A call nobody answered cannot go to the model; a user message carries no tool parts.
    (orjson.dumps(_turn_body("c") | {"messages": [
        {"id": "u", "role": "user", "parts": [{"type": "text", "text": "hi"}]},
        {"id": "a", "role": "assistant", "parts": [{"type": "step-start"}, {
            "type": "tool-get_weather", "toolCallId": "call_1", "state": "input-available", "input": {}}]}]}),
     "tool call 'call_1' has no result (state 'input-available')"),
    (orjson.dumps(_turn_body("c") | {"messages": [{"id": "u", "role": "user", "parts": [
        {"type": "tool-get_weather", "toolCallId": "call_1", "state": "output-available", "output": 1}]}]}),
     "'tool-get_weather' parts are not supported in a user message"),
    (orjson.dumps({**_turn_body("c"), "tools": [{"type": "function", "function": {"name": "has space"}}]}),
     "tools[0].function.name must match"),
]


def test_a_refused_turn_is_a_400_whose_message_the_chat_shows(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    with s.client() as c:
        for body, message in REFUSED:
            r = c.post("/api/chat", content=body, headers={"content-type": "application/json"})
            # DefaultChatTransport makes the body of a non-2xx answer the chat's error message.
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (body, r.text)
            assert message in r.json()["error"]["message"], (body, r.text)


def test_api_routes_need_a_key_and_answer_cors_preflights(aisdk_stack: AisdkStackFactory) -> None:
    origin = "http://app.example"
    rsb = aisdk_stack(cors_origin=origin)
    with httpx.Client(base_url=rsb.url, timeout=10) as c:
        assert c.post("/api/chat", json=_turn_body("c")).status_code == 401
        assert c.get("/api/chat/c/stream").status_code == 401
        assert c.post("/api/chat/c/stop").status_code == 401
        # What a page on another origin sends before each of the SDK's requests.
        for method, path in (("POST", "/api/chat"), ("GET", "/api/chat/c/stream"), ("POST", "/api/chat/c/stop")):
            r = c.options(path, headers={"Origin": origin, "Access-Control-Request-Method": method,
                                         "Access-Control-Request-Headers": "authorization,content-type"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
            assert {"authorization", "content-type"} <= set(r.headers["access-control-allow-headers"].lower().split(", "))
    with rsb.native() as c:
        assert c.get("/api/chat/never/stream").status_code == 204
        assert c.post("/api/chat/never/stop").json()["error"]["code"] == "not_found"


def test_a_draining_pod_ends_the_turn_with_an_error_and_another_pod_resumes_it_from_its_start(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    (pod, url), (_, other) = s.consumer("--heartbeat-s", "1"), s.consumer("--heartbeat-s", "1")
    s.generator(model=slow_model)
    first: list[Any] = []
    with httpx.Client(base_url=url, timeout=30) as c, \
            c.stream("POST", "/api/chat", json=_turn_body("drained", max_tokens=LONG)) as r:
        assert r.headers["x-vercel-ai-ui-message-stream"] == "v1"
        for chunk in ui_chunks(r):
            first.append(chunk)
            if len(first) == 12:
                pod.signal(signal.SIGTERM)
    # Not a clean end, which the SDK would take for the whole answer: an error the page resumes from.
    assert first[-1]["type"] == "error" and "resumeStream()" in first[-1]["errorText"]
    assert "[DONE]" not in first and not any(c.get("type") in ("finish", "abort") for c in first[:-1])
    with httpx.Client(base_url=other, timeout=30) as c, c.stream("GET", "/api/chat/drained/stream") as r:
        assert r.status_code == 200
        again = list(ui_chunks(r))
    # The whole turn again, from its start, under the same message id.
    assert again[:12] == first[:12] and again[0] == {"type": "start", "messageId": first[0]["messageId"]}
    assert [c if isinstance(c, str) else c["type"] for c in again[-4:]] == ["text-end", "finish-step", "finish", "[DONE]"]
    with httpx.Client(base_url=other, timeout=30) as c:
        native = read_sse(c, f"/v1/streams/{first[0]['messageId']}/events")
    assert "".join(c["delta"] for c in again[:-1] if c["type"] == "text-delta") == native.text


def _post_status(url: str, body: dict[str, Any]) -> tuple[int, str | None]:
    """A POST /api/chat's status and, when it got a turn, the turn's message id (then the connection closes)."""
    with httpx.Client(base_url=url, timeout=30) as c, c.stream("POST", "/api/chat", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, None
        for line in r.iter_lines():
            if line.startswith("data: "):
                return 200, str(json.loads(line[6:])["messageId"])
    raise AssertionError("no chunk")


def _first_message_id(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> str:
    """The messageId of an answer's first chunk (then the connection closes)."""
    with httpx.Client(base_url=url, timeout=30) as c, c.stream(method, path, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                return str(json.loads(line[6:])["messageId"])
    raise AssertionError(f"{method} {path}: no chunk")


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_racing_posts_make_one_turn_and_409s(
        where: str, request: pytest.FixtureRequest, stack_factory: StackFactory) -> None:
    """A chat's conversation and its turns' streams sit in different hash slots on a cluster; racing requests
    still make one generation: identical ones name one stream (the create is the idempotent step), different
    ones race for the conversation's one pending turn (one wins, the others get 409)."""
    if where == "standalone":
        request.getfixturevalue("redis_client")  # flushed
        s = stack_factory(request.getfixturevalue("redis_server").url)
        s.consumer()
    else:
        request.getfixturevalue("cluster_client")  # flushed
        s = stack_factory(request.getfixturevalue("redis_cluster").url)
        s.consumer("--partitions", "6")
    # No generator: every turn stays queued, so each answer's first chunk is all a request needs to read.
    post = functools.partial(_first_message_id, s.base_url, "POST", "/api/chat")
    with ThreadPoolExecutor(20) as pool:
        # 20 copies of one POST (a retry storm, tabs posting the same turn): one turn.
        same = list(pool.map(post, [_turn_body("race")] * 20))
        assert len(set(same)) == 1
        # 20 different turns at once: a chat runs one turn at a time, so one gets it, 19 a 409.
        bodies = [_turn_body("race-different", f"q{i}") | {"messages": [{"id": f"u{i}", "role": "user",
                                                               "parts": [{"type": "text", "text": f"q{i}"}]}]}
                  for i in range(20)]
        different = list(pool.map(functools.partial(_post_status, s.base_url), bodies))
    assert sorted(code for code, _ in different) == [200] + [409] * 19, different
    winner = next(mid for code, mid in different if code == 200)
    assert _first_message_id(s.base_url, "GET", "/api/chat/race/stream") == same[0]
    assert _first_message_id(s.base_url, "GET", "/api/chat/race-different/stream") == winner
    # The running turn holds the chat: another new turn of it is a 409 too.
    assert _post_status(s.base_url, _turn_body("race", "later"))[0] == 409
    with s.client() as c:
        for sid in {same[0], winner}:
            assert c.get(f"/v1/streams/{sid}").json()["status"] == "queued"


# -- tools: a client-side tool loop against an upstream that calls tools ----------------------------------

#: The arguments the scripted model gives get_weather (streamed two characters a piece).
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
REASONING = ["The user wants ", "the weather."]


def weather_model() -> Callable[[dict[str, Any]], Reply]:
    """The scripted upstream's answers, as vLLM would stream them: to a question, reasoning and a get_weather
    call (its arguments in pieces; slowly when the question says "(slowly)"); to a tool result, a sentence made
    from it (slowly when the question says "(answer slowly)")."""
    ids = itertools.count(1)

    def respond(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        if messages[-1]["role"] == "tool":
            result = json.loads(messages[-1]["content"])
            words = ["It ", "is ", f"{result['temperature']} ", "degrees ", "in ", f"{result['city']}."]
            return Reply([text(w) for w in words], delay_s=0.4 if "(answer slowly)" in question else 0.0)
        return Reply([*(reasoning(r) for r in REASONING),
                      *tool_call_pieces(0, f"call_{next(ids)}", "get_weather", WEATHER_ARGS, 2)],
                     finish_reason="tool_calls", delay_s=0.15 if "(slowly)" in question else 0.0)

    return respond


def weather_answer(output: dict[str, Any]) -> str:
    return f"It is {output['temperature']} degrees in {output['city']}."


@pytest.fixture
def tool_stack(aisdk_stack: AisdkStackFactory) -> Iterator[tuple[AisdkStack, ScriptedUpstream]]:
    with ScriptedUpstream() as upstream:
        upstream.respond = weather_model()
        yield aisdk_stack(upstream=upstream.url), upstream


def _finished_loop(r: dict[str, Any], s: Streams, *, kept_partial: bool = False) -> dict[str, Any]:
    """The checks of a finished tool loop on screen: one assistant message whose steps are the reasoning, the
    call (its input the model's arguments, its output the page's) and the answer made from that output, each
    once; that message's first turn, read natively, is the call. Returns the tool part.

    ``kept_partial``: ai@5 resuming a message it kept (a reloaded page's persisted partial message) appends the
    replay to it, so the partial step (its reasoning, and the call: a second part for the same call, which
    addToolOutput answers too) stays in front."""
    chat, parts = r["chat"], r["parts"]
    assert chat["status"] == "ready" and chat["error"] is None, chat
    assert chat["roles"] == ["user", "assistant"] and chat["assistants"] == 1
    types = [p["type"] for p in parts]
    partial = ["step-start", "reasoning", "tool-get_weather"] if kept_partial else []
    assert types == [*partial, "step-start", "reasoning", "tool-get_weather", "step-start", "text"], types
    if kept_partial:
        assert parts[2]["toolCallId"] == parts[5]["toolCallId"]
        parts = parts[3:]
        types = types[3:]
    assert [p["text"] for p in parts if p["type"] == "reasoning"] == ["".join(REASONING)]
    tool: dict[str, Any] = parts[types.index("tool-get_weather")]
    assert tool["state"] == "output-available" and tool["input"] == json.loads(WEATHER_ARGS)
    assert tool["output"] == {"city": "Paris", "temperature": 18, "unit": "celsius"}
    assert parts[-1] == {"type": "text", "text": weather_answer(tool["output"]), "state": "done"}
    # The message is its first turn's stream: reasoning, then the call in pieces, ending tool_calls.
    with s.rsb.native() as c:
        first = read_sse(c, f"/v1/streams/{chat['messageId']}/events")
    kinds = [e.event for e in first.events]
    assert "".join(e.data["text"] for e in first.events if e.event == "reasoning") == "".join(REASONING)
    assert [e.data for e in first.events if e.event == "tool_call"] == [
        {"index": 0, "id": tool["toolCallId"], "name": "get_weather"}]
    assert "".join(e.data["text"] for e in first.events if e.event == "tool_args") == WEATHER_ARGS
    assert kinds[-1] == "done" and first.events[-1].data["finish_reason"] == "tool_calls" and "delta" not in kinds
    return tool


def _model_saw_the_result(upstream: ScriptedUpstream, tool: dict[str, Any], requests: int = 2) -> None:
    """What the model was sent: the tool (OpenAI's shape, from the transport's body) both times; the second
    time the call (the arguments as JSON text) and its result (the output as JSON text) after the question."""
    bodies = upstream.bodies()
    assert len(bodies) == requests, [b["messages"] for b in bodies]
    assert all(b["tools"][0]["function"]["name"] == "get_weather" for b in bodies)
    assert bodies[0]["messages"][-1]["role"] == "user"
    *_, asked, called, answered = bodies[-1]["messages"]
    assert asked["role"] == "user" and called["role"] == "assistant" and not called.get("content")
    [call] = called["tool_calls"]
    assert call["id"] == tool["toolCallId"] and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == tool["input"]
    assert answered == {"role": "tool", "tool_call_id": tool["toolCallId"], "content": answered["content"]}
    assert json.loads(answered["content"]) == tool["output"]


@needs_node
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("major", NODE_MAJORS)
def test_a_client_side_tool_loop_runs_and_resumes_in_the_middle_of_a_call(
        major: str, tool_stack: tuple[AisdkStack, ScriptedUpstream], tmp_path: Path) -> None:
    """addToolOutput + sendAutomaticallyWhen (lastAssistantMessageIsCompleteWithToolCalls), with the real
    client: the loop, then a page that leaves in the middle of the call's arguments and is reloaded, then a
    page that opens the chat while the answer after the result streams."""
    require_harness()
    rsb, upstream = tool_stack
    streams = Streams(rsb)

    loop = run_harness(major, rsb, tmp_path / "loop.json", ("toolLoop",))["results"]["toolLoop"]
    assert "exception" not in loop, loop["exception"]
    tool = _finished_loop(loop, streams)
    assert loop["calls"] == [{"toolCallId": tool["toolCallId"], "toolName": "get_weather",
                              "input": json.loads(WEATHER_ARGS)}]  # onToolCall, once
    # The second POST continues the message: the same message id, after the tool's output.
    second = loop["bodies"][1]
    assert second["trigger"] == "submit-message" and second["messageId"] == loop["chat"]["messageId"]
    assert [q[2] for q in _requests(loop["chat"])] == [200, 200]
    _model_saw_the_result(upstream, tool)

    upstream.requests.clear()
    resumed = run_harness(major, rsb, tmp_path / "resume.json", ("toolResume",))["results"]["toolResume"]
    assert "exception" not in resumed, resumed["exception"]
    partial = resumed["partial"]
    assert [p["state"] for p in partial["parts"] if p["type"] == "tool-get_weather"] == ["input-streaming"]
    # ai@6 and ai@7 start the message afresh at the replay's start. ai@5 keeps the reloaded page's partial
    # message and appends the replay to it (docs/aisdk.md: with ai@5, persist a message once it is finished).
    tool = _finished_loop(resumed, streams, kept_partial=major == "ai5")
    assert resumed["chat"]["messageId"] == partial["chat"]["messageId"]
    assert [c["toolCallId"] for c in resumed["calls"]] == [tool["toolCallId"]]  # the tool ran once
    assert [(q[0], q[2]) for q in _requests(resumed["chat"])] == [("GET", 200), ("POST", 200)]
    if major == "ai5":  # the doubled step goes to the model too: the call and its result twice
        assert [m["role"] for m in upstream.bodies()[-1]["messages"]] == ["user", "assistant", "tool", "assistant",
                                                                           "tool"]
    else:
        _model_saw_the_result(upstream, tool)  # one generation per turn: the reload made none

    upstream.requests.clear()
    reopened = run_harness(major, rsb, tmp_path / "reopen.json",
                           ("toolContinuationResume",))["results"]["toolContinuationResume"]
    assert "exception" not in reopened, reopened["exception"]
    tool = _finished_loop(reopened["first"], streams)
    # The second page resumed the message's second turn: its first step (the call and its result) rebuilt
    # from the turn's request, then the answer; no tool run on that page, no reasoning (not kept for it).
    again = reopened["reopened"]
    assert again["chat"]["messageId"] == reopened["first"]["chat"]["messageId"] and again["calls"] == []
    assert [p["type"] for p in again["parts"]] == ["step-start", "tool-get_weather", "step-start", "text"]
    assert again["parts"][1] == tool and again["parts"][-1] == reopened["first"]["parts"][-1]
    assert [(q[0], q[2]) for q in _requests(again["chat"])] == [("GET", 200)]
    _model_saw_the_result(upstream, tool)


@pytest.mark.slow
def test_a_failed_call_goes_to_the_model_as_its_error_and_a_resume_rebuilds_the_continued_message(
        tool_stack: tuple[AisdkStack, ScriptedUpstream]) -> None:
    """The wire, without the SDK: an ``output-error`` tool part is the call's result (its error text); the turn
    continues the assistant message (``start`` names it); a resume of that turn sends the message's earlier
    step first (the call as tool-input-start + tool-input-delta, never tool-input-available, and its result)."""
    rsb, upstream = tool_stack
    words = ["Sorry, ", "the ", "weather ", "service ", "failed ", "just ", "now."]
    upstream.respond = lambda body: Reply([text(w) for w in words], delay_s=0.3)
    tool_part = {"type": "tool-get_weather", "toolCallId": "call_e1", "state": "output-error",
                 "input": {"city": "Paris"}, "errorText": "the service is down"}
    body = {"id": "failed-call", "trigger": "submit-message", "messageId": "a1", "tools": [{
        "type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}], "messages": [
        {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "Weather in Paris?"}]},
        {"id": "a1", "role": "assistant", "parts": [{"type": "step-start"}, {"type": "text", "text": "Checking."},
                                                     tool_part]}]}
    posted: list[Any] = []
    resumed: list[Any] = []
    with rsb.native() as c, c.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200
        for chunk in ui_chunks(r):
            posted.append(chunk)
            if isinstance(chunk, dict) and chunk["type"] == "text-delta" and not resumed:
                # Another page opens the chat while the answer streams: it resumes the running turn.
                with rsb.native() as again, again.stream("GET", "/api/chat/failed-call/stream") as resume:
                    assert resume.status_code == 200
                    resumed += ui_chunks(resume)
    history = upstream.bodies()[-1]["messages"]
    assert history[1:] == [
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_e1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_e1", "content": "the service is down"}]
    kinds = [c if isinstance(c, str) else c["type"] for c in posted]
    assert posted[0] == {"type": "start", "messageId": "a1"} and kinds[1] == "start-step"
    assert "tool-input-start" not in kinds and kinds[-3:] == ["finish-step", "finish", "[DONE]"]
    # The resume: the same message, its earlier step rebuilt, then the turn's chunks as the POST sent them.
    earlier = [
        {"type": "start-step"},
        {"type": "text-start", "id": "text-step0"}, {"type": "text-delta", "id": "text-step0", "delta": "Checking."},
        {"type": "text-end", "id": "text-step0"},
        {"type": "tool-input-start", "toolCallId": "call_e1", "toolName": "get_weather"},
        {"type": "tool-input-delta", "toolCallId": "call_e1", "inputTextDelta": '{"city":"Paris"}'},
        {"type": "tool-output-available", "toolCallId": "call_e1", "output": "the service is down"},
        {"type": "finish-step"}]
    assert resumed == [posted[0], *earlier, *posted[1:]]
