"""Anthropic's Messages view, driven by the official ``anthropic`` SDK (pinned in the [test] extra:
``messages.stream``, ``messages.create``, a tool loop with ``tool_result``, its own stream accumulator) and read raw
with httpx where what is on the wire matters (every event's ``id``, the resume), against real processes:
redis-server, `rsb consumer` with API keys, and `rsb generator --upstream` on a scripted OpenAI-compatible server
(tests/scripted_upstream.py) that streams text, reasoning and tool calls in pieces as vLLM does. Every answer is
compared with what the model streamed, every request the model got is checked."""

from __future__ import annotations

import json
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import redis
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import MessageParam, RawMessageStreamEvent, TextBlock, ThinkingBlock, ToolParam, ToolUseBlock
from helpers import SSE, eventually, sse_blocks
from scripted_upstream import Reply, ScriptedUpstream, reasoning, text, tool_call_pieces
from servers import SharedStack, Stack, StackFactory

from broker.redis.server import RedisServer
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow

WEATHER_TOOL: ToolParam = {"name": "get_weather", "description": "The weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}
ARGS = '{"city": "Paris", "unit": "celsius"}'
THOUGHT = ["The user asks ", "about the weather; ", "I should call get_weather."]
ASK: list[MessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "m"  # an alias every test generator answers to (tests/servers.py)


class Keys:
    def __init__(self, tmp: Path) -> None:
        self.alice, alice = new_key("alice")
        self.bob, bob = new_key("bob")
        self.carol, carol = new_key("carol")  # a small token budget
        self.dave, dave = new_key("dave")  # priority by default
        self.path = tmp / "keys.json"
        self.path.write_text(json.dumps({"keys": [
            alice, bob, {**carol, "token_budget": 100, "budget_period": "day"},
            {**dave, "service_tier": "priority", "service_tiers": ["priority", "default"]}]}))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("anthropic-keys"))


@pytest.fixture(scope="module")
def _upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        yield up


@pytest.fixture(scope="module")
def _stack(demo_model: Path, tmp_path_factory: pytest.TempPathFactory, _upstream: ScriptedUpstream,
           keys: Keys) -> Iterator[SharedStack]:
    server = RedisServer().start()
    s = SharedStack(server, demo_model, tmp_path_factory.mktemp("anthropic-stack"))
    try:
        s.generator("--upstream", _upstream.url, ignore_eos=False)
        s.consumer("--heartbeat-s", "1", "--api-keys", str(keys.path))
        yield s
    finally:
        s.close()
        s.redis.close()
        server.cleanup()


@pytest.fixture
def upstream(_upstream: ScriptedUpstream) -> ScriptedUpstream:
    """The module's scripted model, with no reply left from another test and its requests from this test only."""
    _upstream._replies.clear()
    _upstream.requests.clear()
    return _upstream


@pytest.fixture
def stack(_stack: SharedStack, upstream: ScriptedUpstream) -> Iterator[SharedStack]:
    yield _stack
    _stack.wait_idle()


def _client(stack: SharedStack, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url, api_key=key, max_retries=0)


def _weather_call(call_id: str, *, thought: bool = True, **kw: Any) -> Reply:
    return Reply([*(reasoning(t) for t in (THOUGHT if thought else ())),
                  *tool_call_pieces(0, call_id, "get_weather", ARGS, 4)], finish_reason="tool_calls", **kw)


Stop = Callable[[list[SSE]], bool]


def _auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"x-api-key": key}


def _inputs(events: list[SSE]) -> list[SSE]:
    return [e for e in events if e.data.get("delta", {}).get("type") == "input_json_delta"]


def _post_raw(stack: Stack, key: str | None, body: dict[str, Any], headers: dict[str, str] | None = None,
              stop: Stop | None = None, sink: list[SSE] | None = None) -> tuple[httpx.Response, list[SSE]]:
    """A streamed create read on the wire (``stop``: a predicate on the events so far that cuts the read; ``sink``:
    the list the events go to as they arrive)."""
    events: list[SSE] = [] if sink is None else sink
    with httpx.Client(base_url=stack.base_url, timeout=120) as c, c.stream(
            "POST", "/v1/messages", json={**body, "stream": True},
            headers={**_auth(key), "anthropic-version": "2023-06-01", **(headers or {})}) as r:
        if r.status_code != 200:
            r.read()
            return r, []
        for parsed in sse_blocks(r):
            if isinstance(parsed, SSE):
                events.append(parsed)
                if stop is not None and stop(events):
                    break
    return r, events


def _read_raw(stack: Stack, key: str | None, message_id: str, last_event_id: str | None = None,
              stop: Stop | None = None) -> tuple[int, list[SSE]]:
    headers = {**_auth(key), "accept": "text/event-stream"}
    if last_event_id is not None:
        headers["last-event-id"] = last_event_id
    events: list[SSE] = []
    with httpx.Client(base_url=stack.base_url, timeout=120) as c, c.stream(
            "GET", f"/v1/messages/{message_id}/events", headers=headers) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, []
        for parsed in sse_blocks(r):
            if isinstance(parsed, SSE):
                events.append(parsed)
                if stop is not None and stop(events):
                    break
    return 200, events


def _accumulate(events: list[SSE]) -> Any:
    """The SDK's own accumulator over raw events: the Message they make."""
    snapshot = None
    bufs: dict[int, bytes] = {}
    for e in events:
        if e.event != "ping":
            snapshot = accumulate_event(event=e.data, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


def test_stream_and_create_answer_text_with_anthropics_shapes(stack: SharedStack, upstream: ScriptedUpstream,
                                                             keys: Keys) -> None:
    client = _client(stack, keys.alice)
    upstream.script(Reply([text("Hello"), text(" there"), text("!")], delay_s=0.02))
    with client.messages.stream(model=MODEL, max_tokens=64, system="Be brief.", messages=ASK) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == "Hello there!"
    assert [b.model_dump(exclude_none=True) for b in final.content] == [{"type": "text", "text": "Hello there!"}]
    assert (final.role, final.type, final.stop_reason, final.stop_sequence) == ("assistant", "message", "end_turn",
                                                                               None)
    assert final.model == "scripted-model" and final.id.startswith("msg_")
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.cache_read_input_tokens) == (10, 3, 0)
    sent = upstream.bodies()[-1]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is the weather in Paris?"}]
    assert sent["max_tokens"] == 64

    upstream.script(Reply([text("Hi"), text(" again")]))
    # temperature, top_p and top_k: not in this SDK's signature any more (newer models take none), in the API's.
    message = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, metadata={"user_id": "u-1"},
                                     extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    assert isinstance(message.content[0], TextBlock) and message.content[0].text == "Hi again"
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 2
    sent = upstream.bodies()[-1]
    assert (sent["temperature"], sent["top_p"], sent["top_k"]) == (0.5, 0.9, 5)


def test_every_event_has_an_id_and_its_type(stack: SharedStack, upstream: ScriptedUpstream, keys: Keys) -> None:
    upstream.script(Reply([text("One"), text(" two")], delay_s=0.02))
    r, events = _post_raw(stack, keys.alice, {"model": MODEL, "max_tokens": 16, "messages": ASK})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    types = [e.event for e in events]
    assert types[:3] == ["message_start", "ping", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(e.event == e.data["type"] for e in events)
    ids = [e.id for e in events]
    assert all(ids) and len(set(ids)) == len(ids)
    start = events[0].data["message"]
    assert start == {"id": start["id"], "type": "message", "role": "assistant", "model": "scripted-model",
                     "content": [], "stop_reason": None, "stop_sequence": None,
                     "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                               "output_tokens": 0, "service_tier": "standard"}}
    assert r.headers["x-rsb-stream-id"] == str(uuid.UUID(hex=start["id"].removeprefix("msg_")))
    # Read again: the same events, the same ids.
    status, again = _read_raw(stack, keys.alice, start["id"])
    assert status == 200 and [(e.id, e.data) for e in again] == [(e.id, e.data) for e in events]


def test_a_tool_loop_streams_the_call_and_takes_its_result(stack: SharedStack, upstream: ScriptedUpstream,
                                                           keys: Keys) -> None:
    client = _client(stack, keys.alice)
    upstream.script(_weather_call("call_a1", delay_s=0.01))
    with client.messages.stream(model=MODEL, max_tokens=256, messages=ASK, tools=[WEATHER_TOOL],
                                tool_choice={"type": "auto", "disable_parallel_tool_use": True}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.partial_json for e in events if e.type == "input_json")
    assert partial == ARGS
    assert final.stop_reason == "tool_use"
    [call] = final.content  # no thinking block: the request did not ask for it
    assert isinstance(call, ToolUseBlock)
    assert (call.type, call.id, call.name, call.input) == ("tool_use", "call_a1", "get_weather",
                                                           {"city": "Paris", "unit": "celsius"})
    sent = upstream.bodies()[-1]
    assert sent["tools"] == [{"type": "function", "function": {"name": "get_weather",
                                                               "description": "The weather in a city",
                                                               "parameters": WEATHER_TOOL["input_schema"]}}]
    assert sent.get("tool_choice", "auto") == "auto" and sent["parallel_tool_calls"] is False  # auto: the default

    upstream.script(Reply([text("It is 18 °C "), text("in Paris.")]))
    answer = client.messages.create(model=MODEL, max_tokens=256, tools=[WEATHER_TOOL], messages=[
        *ASK, {"role": "assistant", "content": final.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_a1", "content": "18 °C"},
                                     {"type": "text", "text": "Thanks"}]}])
    assert [b.text for b in answer.content if isinstance(b, TextBlock)] == ["It is 18 °C in Paris."]
    history = upstream.bodies()[-1]["messages"]
    [sent_call] = history[1]["tool_calls"]  # the call's input, sent back as JSON text
    assert (history[1]["role"], history[1]["content"], sent_call["id"], sent_call["function"]["name"]) == (
        "assistant", None, "call_a1", "get_weather")
    assert json.loads(sent_call["function"]["arguments"]) == json.loads(ARGS)
    assert history[2:] == [{"role": "tool", "tool_call_id": "call_a1", "content": "18 °C"},
                           {"role": "user", "content": "Thanks"}]


def test_thinking_shows_the_models_reasoning_only_when_asked(stack: SharedStack, upstream: ScriptedUpstream,
                                                             keys: Keys) -> None:
    client = _client(stack, keys.alice)
    upstream.script(_weather_call("call_t1"))
    with client.messages.stream(model=MODEL, max_tokens=4096, messages=ASK, tools=[WEATHER_TOOL],
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert "".join(e.thinking for e in events if e.type == "thinking") == "".join(THOUGHT)
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert isinstance(final.content[0], ThinkingBlock) and final.content[0].thinking == "".join(THOUGHT)
    assert final.id.endswith("_thinking")
    # Without thinking: the same generation read as the other message id shows no thinking block.
    plain = final.id.removesuffix("_thinking")
    status, read = _read_raw(stack, keys.alice, plain)
    assert status == 200 and [b.type for b in _accumulate(read).content] == ["tool_use"]


def test_stop_reasons_max_tokens_and_stop_sequence(stack: SharedStack, upstream: ScriptedUpstream,
                                                   keys: Keys) -> None:
    client = _client(stack, keys.alice)
    upstream.script(Reply([text("a"), text("b")], finish_reason="length"))
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert cut.stop_reason == "max_tokens" and cut.stop_sequence is None
    # A stop sequence rsb's own filter meets (the scripted model ignores stop): the text before it, and which.
    upstream.script(Reply([text("Count: 1, 2"), text(", 3 END 4, 5")]))
    stopped = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, stop_sequences=["STOP", " END"])
    assert isinstance(stopped.content[0], TextBlock) and stopped.content[0].text == "Count: 1, 2, 3"
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", " END")
    assert upstream.bodies()[-1]["stop"] == ["STOP", " END"]
    # An upstream that stops by itself and says which (vLLM's stop_reason).
    upstream.script(Reply([text("Up to here")], stop_reason="STOP"))
    with client.messages.stream(model=MODEL, max_tokens=64, messages=ASK, stop_sequences=["STOP"]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "STOP")


def test_a_stream_cut_mid_input_json_delta_resumes_into_the_same_message(stack: SharedStack,
                                                                         upstream: ScriptedUpstream,
                                                                         keys: Keys) -> None:
    upstream.script(_weather_call("call_r1", delay_s=0.05))
    body = {"model": MODEL, "max_tokens": 4096, "messages": ASK, "tools": [WEATHER_TOOL],
            "thinking": {"type": "enabled", "budget_tokens": 2048}}

    _, first = _post_raw(stack, keys.alice, body, stop=lambda events: len(_inputs(events)) >= 2)
    message_id = first[0].data["message"]["id"]
    status, rest = _read_raw(stack, keys.alice, message_id, last_event_id=first[-1].id)
    assert status == 200
    assert rest[0].event == "content_block_delta" and rest[0].data["delta"]["type"] == "input_json_delta"
    status, whole = _read_raw(stack, keys.alice, message_id)
    # Exactly once: the two reads are the whole message, event for event, id for id.
    assert [(e.id, e.data) for e in first + rest] == [(e.id, e.data) for e in whole]
    resumed, full = _accumulate(first + rest), _accumulate(whole)
    assert resumed.model_dump() == full.model_dump()
    assert resumed.content[1].input == {"city": "Paris", "unit": "celsius"}
    assert resumed.content[0].thinking == "".join(THOUGHT) and resumed.stop_reason == "tool_use"
    # The SDK reads the same route with its own stream class (what a Python client resumes with).
    client = _client(stack, keys.alice)
    event_type: type[Any] = RawMessageStreamEvent  # type: ignore[assignment]  # a union, as the SDK casts to it
    sdk_rest = client.get(f"/v1/messages/{message_id}/events", cast_to=event_type, stream=True,
                          stream_cls=anthropic.Stream[RawMessageStreamEvent],
                          options={"headers": {"Last-Event-ID": str(first[-1].id)}})
    assert [e.to_dict() for e in sdk_rest] == [e.data for e in rest]
    # After the last event of a message that ended: nothing more (204), as EventSource expects.
    assert _read_raw(stack, keys.alice, message_id, last_event_id=whole[-1].id)[0] == 204
    assert _read_raw(stack, keys.alice, message_id, last_event_id="bogus")[0] == 400


def test_another_key_reads_nothing_and_keys_go_by_either_header(stack: SharedStack, upstream: ScriptedUpstream,
                                                                keys: Keys) -> None:
    upstream.script(Reply([text("secret")]))
    message = _client(stack, keys.alice).messages.create(model=MODEL, max_tokens=8, messages=ASK)
    assert _read_raw(stack, keys.alice, message.id)[0] == 200
    assert _read_raw(stack, keys.bob, message.id)[0] == 404
    with httpx.Client(base_url=stack.base_url, timeout=30) as c:
        r = c.get(f"/v1/messages/{message.id}/events", headers={"authorization": f"Bearer {keys.bob}"})
        assert r.status_code == 404
        assert r.json() == {"type": "error", "error": {"type": "not_found_error", "message": "no stream with this id"}}
        for headers in ({}, {"x-api-key": "alice.wrong"}):
            r = c.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": ASK}, headers=headers)
            assert r.status_code == 401 and r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        _client(stack, "bob.wrong").messages.create(model=MODEL, max_tokens=8, messages=ASK)


def test_an_idempotency_key_joins_the_same_generation(stack: SharedStack, upstream: ScriptedUpstream,
                                                      keys: Keys) -> None:
    upstream.script(Reply([text(f"w{i} ") for i in range(20)], delay_s=0.02))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "messages": ASK}
    headers = {"idempotency-key": str(uuid.uuid4())}
    reads: list[list[SSE]] = []

    def read() -> None:
        reads.append(_post_raw(stack, keys.alice, body, headers)[1])

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(reads) == 3 and len(upstream.bodies()) == 1  # one generation
    assert reads[0][0].data["message"]["id"] == reads[1][0].data["message"]["id"] == reads[2][0].data["message"]["id"]
    assert [(e.id, e.data) for e in reads[0]] == [(e.id, e.data) for e in reads[1]] == [(e.id, e.data)
                                                                                        for e in reads[2]]
    # A retry after the end joins it too (the same message, no second generation); another body is a conflict.
    again = _client(stack, keys.alice).messages.create(model=MODEL, max_tokens=64, messages=ASK, extra_headers=headers)
    assert again.id == reads[0][0].data["message"]["id"] and len(upstream.bodies()) == 1
    with pytest.raises(anthropic.ConflictError):
        _client(stack, keys.alice).messages.create(model=MODEL, max_tokens=65, messages=ASK, extra_headers=headers)
    # Another key's same Idempotency-Key names another generation.
    upstream.script(Reply([text("bob's")]))
    bobs = _client(stack, keys.bob).messages.create(model=MODEL, max_tokens=64, messages=ASK, extra_headers=headers)
    assert bobs.id != again.id and isinstance(bobs.content[0], TextBlock) and bobs.content[0].text == "bob's"


def test_the_same_budgets_tiers_and_ledger_as_every_view(stack: SharedStack, upstream: ScriptedUpstream,
                                                          keys: Keys) -> None:
    # A budget that cannot hold the create: Anthropic's 429, which the SDK must not retry (the budget renews later).
    with pytest.raises(anthropic.RateLimitError) as spent:
        _client(stack, keys.carol).messages.create(model=MODEL, max_tokens=200, messages=ASK)
    assert spent.value.response.headers["x-should-retry"] == "false" and "retry-after" in spent.value.response.headers
    assert isinstance(spent.value.body, dict) and spent.value.body["error"]["type"] == "rate_limit_error"
    # The key's tier, and standard_only asking for the default one.
    upstream.script(Reply([text("fast")]), Reply([text("slow")]))
    dave = _client(stack, keys.dave)
    assert dave.messages.create(model=MODEL, max_tokens=8, messages=ASK).usage.service_tier == "priority"
    assert dave.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                                service_tier="standard_only").usage.service_tier == "standard"
    # Every message is in the key's usage ledger, as every view's generations are.
    with httpx.Client(base_url=stack.base_url, timeout=30) as c:
        report = c.get("/v1/reports/usage", params={"group_by": "tier"}, headers={"x-api-key": keys.dave}).json()
    assert {(r["tier"], r["streams"], r["completion_tokens"]) for r in report["rows"]} == {("priority", 1, 1),
                                                                                          ("default", 1, 1)}


@pytest.mark.parametrize(("body", "expected"), [
    ({"messages": ASK}, "max_tokens: Field required"),
    ({"max_tokens": 8, "messages": ASK, "frequency_penalty": 1}, "frequency_penalty: Extra inputs are not permitted"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}, "'image' block"),
    ({"max_tokens": 8, "messages": [*ASK, {"role": "assistant", "content": "The weather is"}]}, "prefill"),
    ({"max_tokens": 8, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "only custom tools"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, "unexpected `tool_use_id`"),
    ({"max_tokens": 8, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 2048, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 4096}},
     "less than max_tokens"),
    ({"max_tokens": 8, "messages": ASK, "output_config": {"effort": "high"}}, "output_config.effort"),
    ({"max_tokens": 8, "messages": ASK, "stop_sequences": ["a", "b", "c", "d", "e"]}, "'stop_sequences'"),
])
def test_what_rsb_cannot_honour_is_a_400_in_anthropics_shape(stack: SharedStack, keys: Keys, body: dict[str, Any],
                                                              expected: str) -> None:
    with httpx.Client(base_url=stack.base_url, timeout=30) as c:
        r = c.post("/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": keys.alice})
    assert r.status_code == 400, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert set(error["error"]) == {"type", "message"} and error["error"]["type"] == "invalid_request_error"
    assert expected in error["error"]["message"]


def test_the_sdk_raises_its_own_errors(stack: SharedStack, keys: Keys) -> None:
    client = _client(stack, keys.alice)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body={"top_k": -1})
    assert isinstance(bad.value.body, dict) and "'top_k'" in bad.value.body["error"]["message"]


def test_an_unknown_model_is_anthropics_404(stack: SharedStack, keys: Keys) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        _client(stack, keys.alice).messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=ASK)
    assert isinstance(e.value.body, dict) and e.value.body["error"]["type"] == "not_found_error"
    assert "claude-sonnet-4-5" in e.value.body["error"]["message"]


# -- a generator SIGKILLed during an Anthropic stream ------------------------------------------------------------

NOTES_TOOL: ToolParam = {"name": "save_notes", "description": "Save notes", "input_schema": {
    "type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "minLength": 12,
                                                                          "maxLength": 24},
                                               "minItems": 30, "maxItems": 30}},
    "required": ["notes"], "additionalProperties": False}}


def test_a_generator_sigkilled_mid_stream_is_continued_exactly_once(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    """In-process llama.cpp (the demo model, slow enough to kill mid-answer) writes a forced tool call; its worker
    is SIGKILLed in the middle of the call's input and another takes the job over. The stream that stayed
    connected, a reader that resumed from its last id across the crash and a read afterwards are the same events
    with the same ids, and the SDK's accumulator makes of them one tool_use whose input is valid, once."""
    s = stack_factory(redis_server.url)
    s.consumer()
    victim = s.generator("--lease-s", "1", model=slow_model)
    body = {"model": MODEL, "max_tokens": 3000, "messages": [{"role": "user", "content": "Take notes"}],
            "tools": [NOTES_TOOL], "tool_choice": {"type": "tool", "name": "save_notes"}}
    connected: list[SSE] = []
    t = threading.Thread(target=lambda: _post_raw(s, None, body, sink=connected))
    t.start()
    eventually(lambda: len(_inputs(connected)) >= 1, 60, "the call's first input piece")
    message_id = connected[0].data["message"]["id"]
    _, head = _read_raw(s, None, message_id, stop=lambda events: len(_inputs(events)) >= 3)
    assert head[-1].data["delta"]["type"] == "input_json_delta"
    victim.signal(signal.SIGKILL)
    victim.wait(5)
    s.generator("--lease-s", "1", model=slow_model)
    _, tail = _read_raw(s, None, message_id, last_event_id=head[-1].id)
    t.join(180)
    assert redis_client.hget(f"rsb:{{p0}}:s:{uuid.UUID(hex=message_id[4:])}:meta", "attempts") == b"2"
    _, after = _read_raw(s, None, message_id)
    assert after[-1].event == "message_stop"
    assert [(e.id, e.data) for e in connected] == [(e.id, e.data) for e in after]
    assert [(e.id, e.data) for e in head + tail] == [(e.id, e.data) for e in after]
    message = _accumulate(after)
    [call] = message.content
    assert isinstance(call, ToolUseBlock) and call.name == "save_notes" and message.stop_reason == "tool_use"
    notes = call.input["notes"]
    assert isinstance(notes, list) and len(notes) == 30 and all(12 <= len(n) <= 24 for n in notes)
    assert len(_inputs(head)) < len(_inputs(after))  # it went on from where it stopped


# -- LangChain's ChatAnthropic (langchain-anthropic, pinned in the [test] extra) -----------------------------------


def test_langchain_chat_anthropic_tool_loop_streaming_and_structured_output(stack: SharedStack,
                                                                           upstream: ScriptedUpstream,
                                                                           keys: Keys) -> None:
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
    from pydantic import BaseModel

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "18 C"

    chat = ChatAnthropic(model_name=MODEL, base_url=stack.base_url, api_key=keys.alice, max_retries=0,  # type: ignore[arg-type]
                         timeout=60, stop=None)
    bound = chat.bind_tools([get_weather])
    upstream.script(Reply(tool_call_pieces(0, "call_l1", "get_weather", '{"city": "Paris"}'),
                          finish_reason="tool_calls"), Reply([text("18 C "), text("in Paris.")]))
    ask = HumanMessage("Weather in Paris?")
    ai = bound.invoke([ask])
    assert ai.tool_calls == [{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_l1", "type": "tool_call"}]
    assert ai.response_metadata["stop_reason"] == "tool_use"
    done = bound.invoke([ask, ai, ToolMessage("18 C", tool_call_id="call_l1")])
    assert done.text == "18 C in Paris."
    history = upstream.bodies()[-1]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool"] and history[2]["content"] == "18 C"

    # Streamed: the chunks add up to the call (input_json_delta pieces) and the usage of message_delta.
    upstream.script(Reply(tool_call_pieces(0, "call_l2", "get_weather", '{"city": "Oslo"}'),
                          finish_reason="tool_calls"))
    total: AIMessageChunk | None = None
    for chunk in bound.stream([HumanMessage("Weather in Oslo?")]):
        assert isinstance(chunk, AIMessageChunk)
        total = chunk if total is None else total + chunk
    assert total is not None and total.tool_calls[0]["args"] == {"city": "Oslo"}
    assert total.usage_metadata is not None and total.usage_metadata["output_tokens"] == 5

    class City(BaseModel):
        city: str
        population: int

    upstream.script(Reply(tool_call_pieces(0, "call_l3", "City", '{"city": "Oslo", "population": 709000}'),
                          finish_reason="tool_calls"))
    assert chat.with_structured_output(City).invoke("Tell me about Oslo.") == City(city="Oslo", population=709000)
    sent = upstream.bodies()[-1]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "City"}}


# -- count_tokens: asked of a generator of the model, through Redis --------------------------------------------------


def test_count_tokens_is_the_prompt_a_generation_evaluates(stack_factory: StackFactory, redis_server: RedisServer,
                                                           redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.generator()  # in-process llama.cpp: its tokenizer and chat template count
    s.consumer()
    client = anthropic.Anthropic(base_url=s.base_url, api_key="unused", max_retries=0)
    messages: list[MessageParam] = [{"role": "user", "content": "What is the weather in Paris? " * 20},
                                    {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Oslo?"}]
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages, tools=[WEATHER_TOOL])
    generated = client.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=messages,
                                       tools=[WEATHER_TOOL])
    usage = generated.usage
    assert counted.input_tokens > 200
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens < counted.input_tokens
    # Nothing of the prompts stays in Redis: each question went with its answer.
    assert list(redis_client.scan_iter("rsb:tc:ask:*")) == [] and list(redis_client.scan_iter("rsb:tc:ans:*")) == []


def test_count_tokens_where_no_generator_can_answer(stack: SharedStack, keys: Keys) -> None:
    client = _client(stack, keys.alice)
    # The generators of an upstream count nothing: said at once.
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.count_tokens(model=MODEL, messages=ASK)
    assert isinstance(e.value.body, dict) and "counts tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-sonnet-4-5", messages=ASK)
    # A generator that said it counts and then answers nothing: the wait is bounded and leaves nothing behind.
    stack.redis.set("rsb:tc:scripted-model:live", "1", ex=30)
    try:
        with pytest.raises(anthropic.InternalServerError) as over:
            client.messages.count_tokens(model=MODEL, messages=ASK)
        assert over.value.status_code == 529 and over.value.response.headers["retry-after"] == "1"
        assert isinstance(over.value.body, dict) and over.value.body["error"]["type"] == "overloaded_error"
        assert list(stack.redis.scan_iter("rsb:tc:ask:*")) == []
    finally:
        stack.redis.delete("rsb:tc:scripted-model:live", "rsb:tc:scripted-model:q")
