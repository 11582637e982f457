"""The OpenAI views of typed output (tool calls, reasoning, structured output), driven by the official ``openai``
SDK's own helpers (``chat.completions.stream`` / ``.parse``, Responses streaming, background mode and its
resume) against real processes: redis-server, `rsb consumer`, and `rsb generator --upstream` on a scripted
OpenAI-compatible server (tests/scripted_upstream.py) that streams reasoning and tool calls in pieces as vLLM
does. Every answer is compared with what the model streamed and with the rsb stream behind it, read natively;
every request the model got is checked (the tools, the history with its calls and their results)."""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
import redis
from helpers import SSERead, read_sse
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel
from scripted_upstream import Reply, ScriptedUpstream, reasoning, text, tool_call_pieces
from servers import Stack, StackFactory

from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow


class Weather(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


WEATHER_TOOL = openai.pydantic_function_tool(Weather, name="get_weather", description="The weather in a city")
ARGS = '{"city": "Paris", "unit": "celsius"}'
THOUGHT = ["The user asks ", "about the weather; ", "I should call get_weather."]
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                  "parameters": WEATHER_TOOL["function"]["parameters"], "strict": True}


def weather_call(call_id: str, piece_chars: int = 4, **kw: Any) -> Reply:
    """The model's answer to the question: reasoning, then a get_weather call, its arguments in pieces."""
    return Reply([*(reasoning(t) for t in THOUGHT), *tool_call_pieces(0, call_id, "get_weather", ARGS, piece_chars)],
                 finish_reason="tool_calls", **kw)


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        yield up


@pytest.fixture
def typed_stack(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
                upstream: ScriptedUpstream) -> Stack:
    s = stack_factory(redis_server.url)
    s.generator("--upstream", upstream.url, ignore_eos=False)
    s.consumer("--heartbeat-s", "1")
    return s


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def _native(stack: Stack, stream_id: str) -> SSERead:
    with stack.client() as c:
        read = read_sse(c, f"/v1/streams/{stream_id}/events")
    assert read.status == 200 and read.events[-1].event == "done"
    return read


def _typed(read: SSERead, kind: str) -> list[Any]:
    return [e.data for e in read.events if e.event == kind]


def _stream_id(response_id: str) -> str:
    return str(uuid.UUID(hex=response_id.removeprefix("resp_")))


def test_chat_streams_reasoning_and_a_tool_call_in_pieces_and_takes_its_result(
        typed_stack: Stack, upstream: ScriptedUpstream) -> None:
    client = _client(typed_stack)
    upstream.script(weather_call("call_w1"))
    with client.chat.completions.stream(model="m", messages=ASK, tools=[WEATHER_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    # The SDK's own accumulation: one call, its arguments exactly the model's, parsed (a strict tool).
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert "".join(e.arguments_delta for e in pieces) == ARGS and {e.name for e in pieces} == {"get_weather"}
    [done] = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done.arguments == ARGS and done.parsed_arguments == Weather(city="Paris", unit="celsius")
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls or []
    assert (call.id, call.type, call.function.name, call.function.arguments) == ("call_w1", "function", "get_weather",
                                                                                 ARGS)
    assert call.function.parsed_arguments == Weather(city="Paris", unit="celsius")
    # Reasoning arrives as delta.reasoning_content, which the SDK accumulates as it is.
    chunks = [e.chunk for e in events if e.type == "chunk"]
    thought = [(c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks if c.choices]
    assert "".join(t for t in thought if t) == "".join(THOUGHT)
    assert (choice.message.model_extra or {}).get("reasoning_content") == "".join(THOUGHT)
    # A call's first chunk names it (index, id, type, name); the next ones carry only its index and a piece.
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0][0].id == "call_w1" and calls[0][0].function.name == "get_weather"  # type: ignore[union-attr]
    assert all(c[0].id is None and c[0].function.name is None for c in calls[1:])  # type: ignore[union-attr]
    # The model was given the tool as OpenAI shapes it.
    sent = upstream.bodies()[0]
    assert sent["tools"][0]["function"]["name"] == "get_weather" and sent["tools"][0]["function"]["strict"] is True
    assert sent["tools"][0]["function"]["parameters"] == WEATHER_TOOL["function"]["parameters"]
    native = _native(typed_stack, str(uuid.UUID(hex=final.id.removeprefix("chatcmpl-"))))
    assert "".join(r["text"] for r in _typed(native, "reasoning")) == "".join(THOUGHT)
    assert _typed(native, "tool_call") == [{"index": 0, "id": "call_w1", "name": "get_weather"}]
    # One chunk per event (the generator coalesces the pieces that arrive while an append is in flight); the
    # SDK makes an event of the call's first chunk too, with no arguments yet.
    assert [a["text"] for a in _typed(native, "tool_args")] == [e.arguments_delta for e in pieces][1:]
    assert native.events[-1].data["finish_reason"] == "tool_calls"

    # The call's result goes back as a tool message after the assistant message as the SDK returned it.
    upstream.script(Reply([text("It is 18 °C "), text("in Paris.")]))
    messages: list[Any] = [*ASK, choice.message, {"role": "tool", "tool_call_id": "call_w1", "content": '{"temp": 18}'}]
    answer = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL])
    assert answer.choices[0].message.content == "It is 18 °C in Paris." and answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.tool_calls is None
    history = upstream.bodies()[1]["messages"]
    assert history[0] == {"role": "user", "content": "What is the weather in Paris?"}
    assert history[1]["role"] == "assistant" and not history[1].get("content")
    assert history[1]["tool_calls"] == [{"id": "call_w1", "type": "function",
                                         "function": {"name": "get_weather", "arguments": ARGS}}]
    assert history[2] == {"role": "tool", "tool_call_id": "call_w1", "content": '{"temp": 18}'}


def test_chat_returns_tool_calls_and_reasoning_without_streaming(typed_stack: Stack, upstream: ScriptedUpstream) -> None:
    client = _client(typed_stack)
    upstream.script(weather_call("call_w2", piece_chars=3))
    completion = client.chat.completions.parse(model="m", messages=ASK, tools=[WEATHER_TOOL],
                                               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls" and message.content is None
    [call] = message.tool_calls or []
    assert call.id == "call_w2" and call.function.arguments == ARGS
    assert call.function.parsed_arguments == Weather(city="Paris", unit="celsius")
    assert (message.model_extra or {}).get("reasoning_content") == "".join(THOUGHT)
    assert upstream.bodies()[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


def test_chat_parse_gives_the_pydantic_model_of_a_json_schema_answer(typed_stack: Stack,
                                                                     upstream: ScriptedUpstream) -> None:
    client = _client(typed_stack)
    upstream.script(Reply([text(ARGS[i:i + 5]) for i in range(0, len(ARGS), 5)]),
                    Reply([text(ARGS[i:i + 3]) for i in range(0, len(ARGS), 3)]))
    parsed = client.chat.completions.parse(model="m", messages=ASK, response_format=Weather)
    assert parsed.choices[0].message.parsed == Weather(city="Paris", unit="celsius")
    fmt = upstream.bodies()[0]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Weather"
    assert fmt["json_schema"]["strict"] is True and fmt["json_schema"]["schema"]["required"] == ["city", "unit"]
    # Streamed: the SDK's partial parses as the text grows, the model at the end.
    with client.chat.completions.stream(model="m", messages=ASK, response_format=Weather) as stream:
        deltas = [e for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(e.delta for e in deltas) == ARGS and deltas[-1].parsed == {"city": "Paris", "unit": "celsius"}
    assert final.choices[0].message.parsed == Weather(city="Paris", unit="celsius")


def _responses_types(events: list[ResponseStreamEvent]) -> list[str]:
    """The event types, runs of deltas collapsed to one."""
    out: list[str] = []
    for e in events:
        if not (e.type.endswith(".delta") and out and out[-1] == e.type):
            out.append(e.type)
    return out


def test_responses_stream_a_call_resume_in_the_middle_of_its_arguments_and_take_its_output(
        typed_stack: Stack, upstream: ScriptedUpstream) -> None:
    client = _client(typed_stack)
    upstream.script(weather_call("call_r1", piece_chars=2, delay_s=0.05))
    head: list[ResponseStreamEvent] = []
    tools: Any = [RESPONSES_TOOL]
    with client.responses.create(model="m", input="What is the weather in Paris?", tools=tools, background=True,
                                 stream=True) as stream:
        for event in stream:
            head.append(event)
            if [e.type for e in head].count("response.function_call_arguments.delta") == 3:
                break  # the connection drops in the middle of the call's arguments
    rid = head[0].response.id  # type: ignore[union-attr]
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=head[-1].sequence_number))
    events = head + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))  # no gap, no duplicate
    assert _responses_types(events) == [
        "response.created", "response.queued", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(args) == ARGS
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "".join(THOUGHT)
    native = _native(typed_stack, _stream_id(rid))
    assert args == [a["text"] for a in _typed(native, "tool_args")]
    # The SDK's own stream state, fed the two reads one after the other, builds the whole response.
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=tools, text_format=openai.omit)
    built: list[Any] = [out for e in events for out in state.handle_event(e)]
    reasoning_item, call = built[-1].response.output
    assert reasoning_item.type == "reasoning" and reasoning_item.content[0].text == thought
    assert call.type == "function_call" and (call.call_id, call.name, call.arguments) == ("call_r1", "get_weather", ARGS)
    assert call.parsed_arguments == {"city": "Paris", "unit": "celsius"}
    retrieved = client.responses.retrieve(rid)
    assert retrieved.status == "completed" and retrieved.output[1].model_dump() == call.model_dump(
        exclude={"parsed_arguments"})
    assert retrieved.tools[0].name == "get_weather" and retrieved.tool_choice == "auto"  # type: ignore[union-attr]

    # The output goes back as input, with the call's output; the reasoning item is dropped.
    upstream.script(Reply([text("It is 18 °C in Paris.")]))
    items: Any = [{"role": "user", "content": "What is the weather in Paris?"},
                  *[item.model_dump() for item in retrieved.output],
                  {"type": "function_call_output", "call_id": "call_r1", "output": '{"temp": 18}'}]
    follow = client.responses.create(model="m", tools=tools, input=items)
    assert follow.status == "completed" and follow.output_text == "It is 18 °C in Paris."
    history = upstream.bodies()[1]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool"]
    assert history[1]["tool_calls"] == [{"id": "call_r1", "type": "function",
                                         "function": {"name": "get_weather", "arguments": ARGS}}]
    assert history[2] == {"role": "tool", "tool_call_id": "call_r1", "content": '{"temp": 18}'}


def test_responses_text_format_gives_the_parsed_model(typed_stack: Stack, upstream: ScriptedUpstream) -> None:
    client = _client(typed_stack)
    upstream.script(Reply([text(ARGS[i:i + 4]) for i in range(0, len(ARGS), 4)]))
    with client.responses.stream(model="m", input="Weather in Paris, as JSON", text_format=Weather) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_parsed == Weather(city="Paris", unit="celsius")
    assert [e.type for e in events][-1] == "response.completed"
    fmt = upstream.bodies()[0]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Weather" and fmt["json_schema"]["strict"]
    retrieved = client.responses.retrieve(final.id)
    assert retrieved.text.format.type == "json_schema"  # type: ignore[union-attr]
    assert retrieved.text.format.name == "Weather"  # type: ignore[union-attr]


def test_the_durable_streams_view_of_a_generation_carries_its_typed_events(
        typed_stack: Stack, upstream: ScriptedUpstream) -> None:
    upstream.script(weather_call("call_d1"))
    client = _client(typed_stack)
    raw = client.chat.completions.with_raw_response.create(model="m", messages=ASK, tools=[WEATHER_TOOL])
    sid = raw.headers["x-rsb-stream-id"]
    native = _native(typed_stack, sid)
    with typed_stack.client() as c:
        r = c.get(f"/v1/stream/rsb/{sid}", params={"offset": "-1"})
    assert r.status_code == 200 and r.headers["stream-closed"] == "true"
    items = r.json()
    assert items == [{"id": e.id, "type": e.event, "data": e.data} for e in native.events]
    assert {"reasoning", "tool_call", "tool_args"} <= {i["type"] for i in items}
    with typed_stack.client() as c, c.stream("GET", f"/v1/stream/rsb/{sid}",
                                             params={"offset": "-1", "live": "sse"}) as sse:
        body = "".join(sse.iter_text())
    data = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:") and line[5:6] == "["]
    assert [item for batch in data for item in batch] == items


def test_bad_typed_requests_get_openai_errors(typed_stack: Stack) -> None:
    client = _client(typed_stack)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}]}, "messages"),
        ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools"),
        ({"messages": ASK, "tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}}}}},
         "response_format"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", **kwargs)
        assert isinstance(e.value.body, dict) and e.value.body["param"] == param, (kwargs, e.value.body)
    text_format: Any = {"format": {"type": "json_schema", "name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="x", text=text_format)
    schema_error = e.value.body
    assert isinstance(schema_error, dict) and schema_error["param"] == "text"
    assert "uniqueItems" in schema_error["message"] and "text.format.schema" in schema_error["message"]
    with httpx.Client(base_url=typed_stack.base_url) as c:
        r = c.post("/v1/responses", json={"input": [{"type": "function_call", "call_id": "c", "name": "f"}]})
        assert r.status_code == 400 and "input[0].arguments" in r.json()["error"]["message"]


def test_a_generator_killed_in_the_middle_of_a_call_leaves_the_responses_client_the_exact_call(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        upstream: ScriptedUpstream) -> None:
    """SIGKILL the worker while the call's arguments stream: another worker takes the job over and replays the
    request (a deterministic upstream answers the same), and the client that kept reading, like the one that
    resumes with starting_after, gets the call once, exactly, its pieces never twice."""
    upstream.respond = lambda body: weather_call("call_k1", piece_chars=2, delay_s=0.15)
    s = stack_factory(redis_server.url)
    s.consumer("--heartbeat-s", "1")
    victim = s.generator("--upstream", upstream.url, "--lease-s", "1", ignore_eos=False)
    client = _client(s)
    tools: Any = [RESPONSES_TOOL]
    stayed: list[ResponseStreamEvent] = []
    with client.responses.create(model="m", input="What is the weather in Paris?", tools=tools, background=True,
                                 stream=True, temperature=0) as stream:
        for event in stream:
            stayed.append(event)
            if [e.type for e in stayed].count("response.function_call_arguments.delta") == 4:
                victim.signal(signal.SIGKILL)
                victim.wait(5)
                s.generator("--upstream", upstream.url, "--lease-s", "1", ignore_eos=False)
                head = list(stayed)
    rid = stayed[0].response.id  # type: ignore[union-attr]
    resumed = head + list(client.responses.retrieve(rid, stream=True, starting_after=head[-1].sequence_number))
    for events in (stayed, resumed):
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == ARGS
        assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [ARGS]
        assert events[-1].type == "response.completed"
    assert [e.model_dump() for e in stayed] == [e.model_dump() for e in resumed]
    native = _native(s, _stream_id(rid))
    assert "".join(a["text"] for a in _typed(native, "tool_args")) == ARGS
    assert _typed(native, "tool_call") == [{"index": 0, "id": "call_k1", "name": "get_weather"}]
    # The survivor sent the request again as it was first sent (the replay the continuation checks against).
    first, again = upstream.bodies()
    assert again == first
    assert redis_client.hget(f"rsb:{{p0}}:s:{_stream_id(rid)}:meta", "attempts") == b"2"


def test_the_real_default_model_answers_parse_and_a_forced_tool_with_valid_json(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, default_gguf: Path) -> None:
    """In-process llama.cpp on the real default model (SmolLM2-135M), whose free answer is prose: constrained
    decoding makes the SDK's `.parse` get the Pydantic model, and a forced tool a call whose arguments parse,
    streamed through the views like any other answer."""
    s = stack_factory(redis_server.url)
    s.generator(model=default_gguf, ignore_eos=False)
    s.consumer("--heartbeat-s", "1")
    client = _client(s)
    parsed = client.chat.completions.parse(model="m", messages=ASK, response_format=Weather, max_tokens=60,
                                           temperature=0)
    assert parsed.choices[0].finish_reason == "stop" and isinstance(parsed.choices[0].message.parsed, Weather)
    with client.chat.completions.stream(model="m", messages=ASK, tools=[WEATHER_TOOL], max_tokens=60, temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}}
                                        ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments, Weather)
    native = _native(s, str(uuid.UUID(hex=final.id.removeprefix("chatcmpl-"))))
    assert "".join(a["text"] for a in _typed(native, "tool_args")) == call.function.arguments


def test_calls_past_the_bound_or_of_tools_not_offered_are_never_presented(
        typed_stack: Stack, upstream: ScriptedUpstream) -> None:
    client = _client(typed_stack)
    two = Reply([*tool_call_pieces(0, "call_1", "get_weather", ARGS), *tool_call_pieces(1, "call_2", "get_weather",
                                                                                      ARGS)], finish_reason="tool_calls")
    upstream.script(two)
    got = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL], parallel_tool_calls=False)
    assert [c.id for c in got.choices[0].message.tool_calls or ()] == ["call_1"]
    assert got.choices[0].finish_reason == "tool_calls" and upstream.bodies()[-1]["parallel_tool_calls"] is False
    upstream.script(Reply([text("Sure. "), *tool_call_pieces(0, "call_3", "rm_rf", '{"path": "/"}')],
                          finish_reason="tool_calls"))
    with httpx.Client(base_url=typed_stack.base_url) as c:
        sid = str(uuid.uuid4())
        assert c.post("/v1/streams", json={"id": sid, "messages": ASK, "tools": [WEATHER_TOOL]}).status_code == 201
        read = read_sse(c, f"/v1/streams/{sid}/events")
    assert [e.event for e in read.events if e.event in ("tool_call", "tool_args")] == []
    assert read.events[-1].event == "error" and read.events[-1].data["code"] == "undeclared_tool"
    assert "".join(e.data["text"] for e in read.events if e.event == "delta") == "Sure. "
