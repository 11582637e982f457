"""Sending again while a conversation's answer runs (``on_busy``), against real redis-server, `rsb generator` and
`rsb consumer` processes: on the real default model (SmolLM2), ``interrupt`` mid-answer stops the generation for
real and the new turn's prompt holds the partial answer, which stays in the history; ``enqueue`` runs after the
answer it waited for, on a prompt holding it; two pods taking two interrupts at the same moment make one turn run
and nothing run twice; the OpenAI Responses view takes ``on_busy`` with its conversations (the real SDK), and the AI
SDK view takes it in the transport's body (the real ``ai`` client: tests/aisdk/harness/joiners.mjs)."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
from aisdk_harness import require_harness, scenario_result, start_scenario
from helpers import read_sse, wait_status
from servers import StackFactory

from broker.events import parse_event_id
from broker.redis.server import RedisServer
from broker.streams.keys import StreamKeys
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow


def _engine_messages(r: redis.Redis, sid: str) -> list[tuple[str, str]]:
    """The messages the engine was given: the stream's request as stored (as the worker read it)."""
    raw = r.hget(StreamKeys.of(uuid.UUID(sid), 1).meta, "req")
    assert isinstance(raw, bytes), sid
    return [(m["role"], m["content"]) for m in orjson.loads(raw)["messages"]]


def _key(event_id: str | None) -> tuple[int, int]:
    """An event id as the Redis server's clock (milliseconds, sequence): what orders events across streams."""
    key = parse_event_id(event_id or "")
    assert key is not None, event_id
    return key


def _turn(c: httpx.Client, conv: str, text: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    r = c.post("/v1/streams", json={"conversation": conv, "messages": [{"role": "user", "content": text}],
                                    "max_tokens": max_tokens, **fields})
    assert r.status_code == 201, r.text
    return dict(r.json())


def _read(c: httpx.Client, sid: str) -> Any:
    read = read_sse(c, f"/v1/streams/{sid}/events", timeout_s=120)
    assert read.status == 200
    return read


def test_interrupt_mid_answer_then_enqueue_on_the_default_model(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, default_gguf: Path) -> None:
    s = stack_factory(redis_server.url)
    s.generator(model=default_gguf, ignore_eos=True)
    s.consumer("--heartbeat-s", "1")
    conv = str(uuid.uuid4())
    with s.client() as c:
        first = _turn(c, conv, "Tell me a long story about a dragon who learns to cook.", 400)
        # Read until the answer is well under way, then send again with interrupt.
        seen: list[str] = []
        read_sse(c, f"/v1/streams/{first['id']}/events", stop_after=30,
                 on_event=lambda e: seen.append(e.data.get("text", "")) if e.event == "delta" else None)
        assert "".join(seen).strip(), "no answer before the interrupt"
        second = _turn(c, conv, "Stop. Just tell me what two plus two is.", 24, on_busy="interrupt")
        assert second["status"] == "queued"
        # The first turn stops for real: cancelled by the client, far short of its 400 tokens.
        one = _read(c, first["id"])
        assert one.events[-1].event == "cancelled" and one.events[-1].data["reason"] == "client"
        assert 0 < one.events[-1].data["usage"]["completion_tokens"] < 400
        partial = one.text
        assert partial.startswith("".join(seen))
        two = _read(c, second["id"])
        assert two.events[-1].event == "done" and two.text
        # The partial answer is the history: in the new turn's prompt, and in the conversation read back.
        assert _engine_messages(redis_client, second["id"]) == [
            ("user", "Tell me a long story about a dragon who learns to cook."), ("assistant", partial),
            ("user", "Stop. Just tell me what two plus two is.")]
        turns = c.get(f"/v1/conversations/{conv}/turns").json()["turns"]
        assert [(t["status"], t["output"]["text"]) for t in turns] == [("cancelled", partial), ("done", two.text)]

        # enqueue: the third turn waits for the answer being written, then runs on a prompt that holds it.
        third = _turn(c, conv, "Now say it in French.", 48)
        fourth = _turn(c, conv, "And in German.", 16, on_busy="enqueue")
        queued = read_sse(c, f"/v1/streams/{fourth['id']}/events", stop_after=1).events[0]
        assert queued.event == "queued" and queued.data["waiting_for"] == third["id"]
        three, four = _read(c, third["id"]), _read(c, fourth["id"])
        assert three.events[-1].event == "done" and four.events[-1].event == "done"
        started = next(e for e in four.events if e.event == "started")
        assert _key(started.id) >= _key(three.events[-1].id)  # ids are the Redis server's clock: it ran after
        assert _engine_messages(redis_client, fourth["id"])[-3:] == [
            ("user", "Now say it in French."), ("assistant", three.text), ("user", "And in German.")]
        wait_status(c, fourth["id"], {"done"})


def test_two_pods_taking_two_interrupts_at_once_run_one_turn(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.generator(ignore_eos=True, model=slow_model)
    _, pod_a = s.consumer("--heartbeat-s", "1")
    _, pod_b = s.consumer("--heartbeat-s", "1")
    conv = str(uuid.uuid4())
    with httpx.Client(base_url=pod_a, timeout=30) as a, httpx.Client(base_url=pod_b, timeout=30) as b:
        running = _turn(a, conv, "Go on forever.", 4000)
        read_sse(a, f"/v1/streams/{running['id']}/events", stop_after=5)
        go = threading.Barrier(2)

        def interrupt(c: httpx.Client, text: str) -> dict[str, Any]:
            go.wait()
            return _turn(c, conv, text, 8, on_busy="interrupt")

        with ThreadPoolExecutor(2) as pool:
            x, y = pool.map(lambda args: interrupt(*args), [(a, "from pod A"), (b, "from pod B")])
        reads = {t["id"]: _read(a, t["id"]) for t in (running, x, y)}
        ends = {sid: read.events[-1] for sid, read in reads.items()}
        assert ends[running["id"]].event == "cancelled"
        # The later interrupt in line wins and the earlier one is cancelled. Usually it never ran; when the running
        # turn ended before the later request reached Redis (two pods, no order between them), it was claimed first
        # and then interrupted like any running turn: cancelled either way, never done.
        winner = next(t for t in (x, y) if ends[t["id"]].event == "done")
        loser = next(t for t in (x, y) if t is not winner)
        assert ends[loser["id"]].event == "cancelled"
        if "started" not in [e.event for e in reads[loser["id"]].events]:
            assert ends[loser["id"]].data["usage"]["completion_tokens"] == 0
        assert _engine_messages(redis_client, winner["id"])[:2] == [
            ("user", "Go on forever."), ("assistant", reads[running["id"]].text)]
        turns = b.get(f"/v1/conversations/{conv}/turns").json()["turns"]
        assert [t["id"] for t in turns] == [running["id"], loser["id"], winner["id"]]
        assert [t["status"] for t in turns] == ["cancelled", "cancelled", "done"]

        # The OpenAI Responses view: a response of the conversation while another runs waits (enqueue) or 409s.
        client = openai.OpenAI(base_url=f"{pod_b}/v1", api_key="unused", max_retries=0)
        conv_id = "conv_" + uuid.UUID(conv).hex
        busy = client.responses.create(model="m", input="Keep going.", conversation=conv_id, background=True,
                                       max_output_tokens=2000)
        with pytest.raises(openai.ConflictError):
            client.responses.create(model="m", input="Too soon.", conversation=conv_id, max_output_tokens=8)
        after = client.responses.create(model="m", input="Then this.", conversation=conv_id, background=True,
                                        max_output_tokens=8, extra_body={"on_busy": "enqueue"})
        assert after.status == "queued"
        client.responses.cancel(busy.id)
        _read(b, str(uuid.UUID(hex=after.id[len("resp_"):])))  # to its end
        done = client.responses.retrieve(after.id)
        assert done.status == "incomplete" and done.output_text  # max_output_tokens reached: it ran
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="m", input="x", conversation=conv_id, max_output_tokens=8,
                                    extra_body={"on_busy": "later"})


# -- the AI SDK view, driven by the real `ai` client ---------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("major", ["ai5", "ai6", "ai7"])
def test_ai_sdk_pages_that_send_again(major: str, stack_factory: StackFactory, redis_server: RedisServer,
                                      redis_client: redis.Redis, slow_model: Path, tmp_path: Path) -> None:
    """A page that stops reading and sends again with on_busy 'interrupt' (the running answer stops, its partial
    answer is the new turn's history), and a second device that sends with on_busy 'enqueue' while the first's
    answer runs (it waits, then runs on the whole answer)."""
    require_harness()
    key_a, entry_a = new_key("alice")
    key_b, entry_b = new_key("bob")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [entry_a, entry_b]}))
    s = stack_factory(redis_server.url)
    s.generator(model=slow_model, ignore_eos=True)
    _, url = s.consumer("--api-keys", str(keys), "--heartbeat-s", "1")
    native = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {key_a}"})
    with native:
        r = scenario_result(start_scenario(major, url, (key_a, key_b), "interruptSend", tmp_path / "i.json",
                                           RSB_LONG_TOKENS="600", RSB_SHORT_TOKENS="16"),
                            tmp_path / "i.json", "interruptSend")
        assert r["partial"]["status"] == "ready"
        final, messages = r["final"], r["messages"]
        assert final["status"] == "ready" and final["error"] is None, final
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        stopped, answer = messages[1]["id"], messages[3]["id"]
        one, two = _read(native, stopped), _read(native, answer)
        assert one.events[-1].event == "cancelled" and one.events[-1].data["reason"] == "client"
        assert one.events[-1].data["usage"]["completion_tokens"] < 5 * 600
        assert two.events[-1].event == "done" and messages[3]["text"] == two.text
        assert _engine_messages(redis_client, answer) == [
            ("user", "tell me a long story"), ("assistant", one.text), ("user", "stop, say hi")]

        r = scenario_result(start_scenario(major, url, (key_a, key_b), "enqueueSecondDevice", tmp_path / "e.json",
                                           RSB_LONG_TOKENS="300", RSB_SHORT_TOKENS="16"),
                            tmp_path / "e.json", "enqueueSecondDevice")
        first, second = r["first"], r["second"]
        assert first["status"] == second["status"] == "ready" and second["error"] is None, r
        assert r["loaded"]["active"] is True
        a, b = _read(native, first["messageId"]), _read(native, second["messageId"])
        assert a.events[-1].event == b.events[-1].event == "done"
        assert first["text"] == a.text and second["text"] == b.text
        assert _key(next(e.id for e in b.events if e.event == "started")) >= _key(a.events[-1].id)
        assert _engine_messages(redis_client, second["messageId"]) == [
            ("user", "first question"), ("assistant", a.text), ("user", "second question")]
        assert "data-rsb-queued" in second["data"]
