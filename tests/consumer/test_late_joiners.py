"""Late joiners over HTTP, against real `rsb consumer` and redis-server processes: ``?from=latest`` on the native
events route (raw SSE, and the Python client's ``Answer``) and on the AI SDK's resume route, read by the real
``ai`` client (ai@5, ai@6, ai@7: tests/aisdk/harness/joiners.mjs); and ``reset-step`` for ai@7 when a failover
takes back text a page was shown. The turn's events are written by the stand-in for the generator
(tests/typed_streams.py), so every piece is known: reasoning, text, a tool call stopped mid-arguments when the
joiner comes, the rest after."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from aisdk_harness import require_harness, scenario_result, start_scenario
from helpers import eventually, metric, parse_sse_block, wait_readers_sync
from servers import StackFactory
from typed_streams import StandInGenerator

from broker.redis.server import RedisServer
from consumer.edge.auth import new_key
from rsb import Answer, Client

pytestmark = pytest.mark.slow

ARGS = json.dumps({"city": "Zürich", "days": 3, "note": 'say "hi"'})
#: What the stand-in writes before the joiners come: reasoning, text, and a call stopped mid-arguments.
BEFORE: list[tuple[str, dict[str, Any]]] = [
    ("reasoning", {"text": "The user wants "}), ("reasoning", {"text": "the weather."}),
    ("delta", {"text": "Let me "}), ("delta", {"text": "check. "}),
    ("tool_call", {"index": 0, "id": "call_1", "name": "get_weather"}),
    *[("tool_args", {"index": 0, "text": ARGS[i:i + 6]}) for i in range(0, 18, 6)],
]
#: And after: the rest of the arguments.
AFTER: list[tuple[str, dict[str, Any]]] = [("tool_args", {"index": 0, "text": ARGS[i:i + 6]})
                                           for i in range(18, len(ARGS), 6)]


class Rsb:
    """A consumer with two API keys and no generator: the stand-in writes every turn."""

    def __init__(self, stack_factory: StackFactory, redis_url: str, tmp: Path) -> None:
        self.key_a, entry_a = new_key("alice")
        self.key_b, entry_b = new_key("bob")
        keys = tmp / "keys.json"
        keys.write_bytes(orjson.dumps({"keys": [entry_a, entry_b]}))
        self.redis_url = redis_url
        _, self.url = stack_factory(redis_url).consumer("--api-keys", str(keys), "--heartbeat-s", "1")
        self.auth = {"Authorization": f"Bearer {self.key_a}"}
        self.keys = (self.key_a, self.key_b)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, headers=self.auth)

    def chat_turn(self, chat_id: str, text: str) -> str:
        """POST /api/chat (the turn starts; this reader leaves at once); the turn's stream id."""
        body = {"id": chat_id, "trigger": "submit-message",
                "messages": [{"id": f"u-{chat_id}", "role": "user", "parts": [{"type": "text", "text": text}]}]}
        with self.http() as c, c.stream("POST", "/api/chat", json=body) as r:
            assert r.status_code == 200, r.read()
            return r.headers["x-rsb-stream-id"]

    def readers(self, n: int) -> None:
        wait_readers_sync(self.url, n, 30, headers=self.auth)


@pytest.fixture
def rsb(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> Rsb:
    return Rsb(stack_factory, redis_server.url, tmp_path)


def _first_block(c: httpx.Client, url: str, headers: dict[str, str] | None = None) -> Any:
    with c.stream("GET", url, headers=headers) as r:
        assert r.status_code == 200, r.read()
        buf = b""
        for chunk in r.iter_bytes():
            buf += chunk
            if b"\n\n" in buf:
                return parse_sse_block(buf.split(b"\n\n", 1)[0])
    raise AssertionError("no event")


def test_a_native_late_joiner_gets_a_snapshot_then_the_tail_and_a_failover_a_new_snapshot(rsb: Rsb) -> None:
    with Client(rsb.url, api_key=rsb.key_a) as client, rsb.http() as c:
        sid = client.create(prompt="What is the weather?", max_tokens=64).id
        gen = StandInGenerator(rsb.redis_url, sid)
        gen.start()
        gen.append(*BEFORE)
        last = gen.ids()[-1]
        first = _first_block(c, f"/v1/streams/{sid}/events?from=latest")
        assert (first.id, first.event) == (last, "snapshot")
        assert first.data == {"text": "Let me check. ", "reasoning": "The user wants the weather.",
                              "tool_calls": [{"index": 0, "id": "call_1", "name": "get_weather",
                                              "arguments": ARGS[:18]}], "last_event_id": last}
        assert c.get(f"/v1/streams/{sid}/events?from=start").status_code == 400
        # Another key's late joiner sees nothing of it.
        assert c.get(f"/v1/streams/{sid}/events?from=latest",
                     headers={"Authorization": f"Bearer {rsb.key_b}"}).status_code == 404

        # A late joiner through the client, finishing after the stream's end: the same answer as a full read.
        answer = Answer()
        kinds: list[str] = []

        def join() -> None:
            for event in client.stream(sid, latest=True):
                kinds.append(event.type)
                answer.feed(event)

        with ThreadPoolExecutor(1) as pool:
            reading = pool.submit(join)
            rsb.readers(1)
            gen.append(*AFTER, ("delta", {"text": "Sunny."}))
            gen.finish("tool_calls", completion_tokens=20)
            reading.result(timeout=30)
        whole = client.answer(sid)
        assert kinds[0] == "snapshot" and kinds[-1] == "done" and "reset" not in kinds
        assert (answer.text, answer.reasoning) == (whole.text, whole.reasoning) == (
            "Let me check. Sunny.", "The user wants the weather.")
        assert [(t.id, t.name, t.arguments) for t in answer.tool_calls] == [("call_1", "get_weather", ARGS)]
        assert answer.tool_calls[0].parsed_arguments == json.loads(ARGS)

        # A reconnect from the latest with the snapshot's id, after a failover lost that very event: a new
        # snapshot of the stream as it now is, where a plain resume would get a reset.
        sid2 = client.create(prompt="Again?", max_tokens=64).id
        gen2 = StandInGenerator(rsb.redis_url, sid2)
        gen2.start()
        gen2.append(*BEFORE)
        snap = _first_block(c, f"/v1/streams/{sid2}/events?from=latest")
        gen2.lose_tail(gen2.ids()[-2:])
        again = _first_block(c, f"/v1/streams/{sid2}/events?from=latest", headers={"Last-Event-ID": snap.id})
        assert again.event == "snapshot" and again.data["tool_calls"][0]["arguments"] == ARGS[:6]
        plain = _first_block(c, f"/v1/streams/{sid2}/events", headers={"Last-Event-ID": snap.id})
        assert plain.event == "reset"


# -- the AI SDK view, read by the real `ai` client -----------------------------------------------------------


def _chunks(body: str) -> list[Any]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _shown(parts: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What a message shows: each part's type and content (not its streaming state)."""
    return [(p["type"], p.get("text"), p.get("input"), p.get("toolCallId")) for p in parts]


@pytest.mark.timeout(240)
def test_ai_sdk_pages_that_join_late_show_what_a_full_replay_shows(rsb: Rsb, tmp_path: Path) -> None:
    """ai@5, ai@6 and ai@7 at once on one running turn: per major a page that resumes it from its start, one that
    resumes it from the latest, and the raw body of a read from the latest. The turn goes on (the call's arguments
    end, text follows) once all nine read; each late page ends with exactly the message its full page shows."""
    require_harness()
    chat_id = f"late-{uuid.uuid4()}"
    sid = rsb.chat_turn(chat_id, "What is the weather in Zürich?")
    gen = StandInGenerator(rsb.redis_url, sid)
    gen.start()
    gen.append(*BEFORE)
    last = gen.ids()[-1]
    majors = ("ai5", "ai6", "ai7")
    runs = {m: start_scenario(m, rsb.url, rsb.keys, "lateJoin", tmp_path / f"{m}.json", {"chatId": chat_id})
            for m in majors}
    rsb.readers(3 * len(majors))  # every late read has taken its snapshot before it counts as a reader
    gen.append(*AFTER, ("delta", {"text": "Sunny."}))
    gen.finish("tool_calls", completion_tokens=20)
    for major, run in runs.items():
        r = scenario_result(run, tmp_path / f"{major}.json", "lateJoin")
        full, joiner = r["full"], r["joiner"]
        assert joiner["chat"]["status"] == full["chat"]["status"] == "ready", (major, r)
        assert joiner["chat"]["messageId"] == full["chat"]["messageId"] == sid
        assert _shown(joiner["parts"]) == _shown(full["parts"]), major
        parts = joiner["parts"]
        assert [p["type"] for p in parts] == ["step-start", "reasoning", "text", "tool-get_weather", "text"]
        assert [p.get("text") for p in parts[1:3]] == ["The user wants the weather.", "Let me check. "]
        assert parts[3]["input"] == json.loads(ARGS) and parts[3]["state"] == "input-available"
        assert parts[4]["text"] == "Sunny."
        # The late page's read: the message so far as one start and one delta per part, then the tail.
        body = joiner["bodies"][0]["text"]
        chunks = _chunks(body)
        snapshot = [c for block in body.split("\n\n") if "event: snapshot" in block
                    for c in _chunks(block)]
        assert body.startswith(f"id: {last}\nevent: snapshot\ndata: ")
        assert [c["type"] for c in snapshot] == [
            "start", "start-step", "message-metadata", "reasoning-start", "reasoning-delta", "reasoning-end",
            "text-start", "text-delta", "text-end", "tool-input-start", "tool-input-delta"]
        assert snapshot[4]["delta"] == "The user wants the weather." and snapshot[7]["delta"] == "Let me check. "
        assert snapshot[10]["inputTextDelta"] == ARGS[:18]
        assert chunks[len(snapshot)]["type"] == "tool-input-delta"  # the tail goes on with the call's arguments
        assert r["raw"]["text"].split("\n\n")[0] == body.split("\n\n")[0]


@pytest.mark.timeout(180)
def test_ai7_takes_back_what_a_failover_lost_with_reset_step(rsb: Rsb, redis_server: RedisServer,
                                                            tmp_path: Path) -> None:
    """?reset_step=1: a page shows the answer's text; a failover loses its last two deltas (the pod's reader finds
    out when it resyncs: here its pub/sub connection is killed) and the stream goes on with others. The page gets
    reset-step and the text as it now is: its message ends as the stream's, no text twice."""
    require_harness()
    chat_id = f"reset-{uuid.uuid4()}"
    sid = rsb.chat_turn(chat_id, "Count.")
    gen = StandInGenerator(rsb.redis_url, sid)
    gen.start()
    gen.append(*[("delta", {"text": f"{i} "}) for i in range(6)])
    ready = tmp_path / "ready"
    run = start_scenario("ai7", rsb.url, rsb.keys, "resetStep", tmp_path / "ai7.json",
                         {"chatId": chat_id, "readyFile": str(ready), "readyText": "0 1 2 3 4 5 "})
    eventually(ready.exists, 60, "the page showing the text")
    gen.lose_tail(gen.ids()[-2:])  # "4 " and "5 ", which the page shows
    # The failover as the pod lives it: its pub/sub connection breaks; once it is back its readers re-read their
    # range, and this one finds its place gone.
    r = redis.Redis(port=redis_server.port)
    try:
        r.client_kill_filter(_type="pubsub")
    finally:
        r.close()
    eventually(lambda: metric(httpx.get(f"{rsb.url}/metrics", headers=rsb.auth, timeout=10).text,
                              "rsb_live_hub_reconnects") >= 1, 30, "the hub's reconnect")
    gen.append(("delta", {"text": "four "}), ("delta", {"text": "five"}))
    gen.finish()
    result = scenario_result(run, tmp_path / "ai7.json", "resetStep")
    chunks = _chunks(result["bodies"][0]["text"])
    assert {"type": "reset-step"} in chunks
    assert result["chat"]["text"] == "0 1 2 3 four five" and result["chat"]["textParts"] == 1
    assert result["chat"]["status"] == "ready"
