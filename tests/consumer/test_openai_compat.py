"""The OpenAI-compatible views, driven by the real ``openai`` SDK (sync and async clients) against a real
stack: redis-server, `rsb generator` running llama.cpp, `rsb consumer`. Every OpenAI object is checked
against the rsb stream behind it, read over the native SSE route."""

from __future__ import annotations

import functools
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
from helpers import SSERead, create, eventually, read_sse, wait_status
from openai.types.chat import ChatCompletionContentPartTextParam, ChatCompletionMessageParam
from openai.types.responses import (
    Response,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseIncompleteEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseStreamEvent,
    ResponseTextDoneEvent,
)
from servers import SharedStack, StackFactory

from broker.redis.server import RedisServer
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story"}]


def _client(base_url: str, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
    # No retries unless a test asks: a retry would hide the status the server answered.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=kwargs.pop("max_retries", 0),
                         **kwargs)


def _native(base_url: str, stream_id: str, headers: dict[str, str] | None = None) -> SSERead:
    with httpx.Client(base_url=base_url, timeout=30, headers=headers) as c:
        full = read_sse(c, f"/v1/streams/{stream_id}/events")
    assert full.status == 200 and full.events[-1].event in ("done", "cancelled", "error")
    return full


def _stream_id(response_id: str) -> str:
    assert response_id.startswith("resp_")
    return str(uuid.UUID(hex=response_id[len("resp_"):]))


def _dumps(events: Sequence[openai.BaseModel]) -> list[dict[str, Any]]:
    return [e.model_dump() for e in events]


def _ended(client: openai.OpenAI, response_id: str) -> Response:
    """A background response once it has ended (a poll with a deadline)."""

    def ended() -> Response | None:
        resp = client.responses.retrieve(response_id)
        return resp if resp.status in ("completed", "incomplete", "failed", "cancelled") else None

    return eventually(ended, 60, f"{response_id} ended", interval_s=0.1)


def _metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_chat_stream_is_the_rsb_stream_read_as_chunks(shared_stack: SharedStack) -> None:
    client = _client(shared_stack.base_url)
    raw = client.chat.completions.with_raw_response.create(
        model="story-model", messages=CHAT, max_tokens=32, stream=True, stream_options={"include_usage": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    sid = raw.headers["x-rsb-stream-id"]
    chunks = list(raw.parse())
    # The model that ran ("story-model" is an alias of the test generator's model), in every chunk.
    native_model = _native(shared_stack.base_url, sid).events[1].data["model"]
    assert native_model != "story-model"
    assert {(c.id, c.object, c.created, c.model, c.service_tier) for c in chunks} == {
        (f"chatcmpl-{uuid.UUID(sid).hex}", "chat.completion.chunk", chunks[0].created, native_model, "default")}
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, final, usage_chunk = chunks
    assert [c.choices[0].finish_reason for c in body] == [None] * len(body)
    assert final.choices[0].finish_reason == "length" and final.choices[0].delta.content is None
    text = "".join(c.choices[0].delta.content or "" for c in body)

    native = _native(shared_stack.base_url, sid)
    assert text == native.text and text
    usage = native.events[-1].data["usage"]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == usage["completion_tokens"] == 32
    assert usage_chunk.usage.prompt_tokens == usage["prompt_tokens"] > 0
    assert usage_chunk.usage.total_tokens == 32 + usage["prompt_tokens"]


def test_chat_without_stream_answers_the_whole_completion_once_it_ends(shared_stack: SharedStack) -> None:
    client = _client(shared_stack.base_url)
    parts: list[ChatCompletionContentPartTextParam] = [{"type": "text", "text": "Tell me "},
                                                       {"type": "text", "text": "a story"}]
    messages: list[ChatCompletionMessageParam] = [{"role": "developer", "content": "Be brief."},
                                                  {"role": "user", "content": parts}]
    raw = client.chat.completions.with_raw_response.create(model="m", messages=messages, max_completion_tokens=20,
                                                           temperature=0.5, top_p=0.9, seed=7, stop=["\n\n\n"])
    sid = raw.headers["x-rsb-stream-id"]
    completion = raw.parse()
    native = _native(shared_stack.base_url, sid)
    assert completion.object == "chat.completion" and completion.id == f"chatcmpl-{uuid.UUID(sid).hex}"
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == native.text
    assert choice.finish_reason == native.events[-1].data["finish_reason"] == "length"
    usage = native.events[-1].data["usage"]
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (usage["prompt_tokens"], 20)
    # What was stored is this native request (a retry of it is "identical": 200, created false): the developer
    # message became the system one, the text parts were joined, every sampling parameter was carried over.
    native_body = {"id": sid, "model": "m", "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "seed": 7,
                   "stop": ["\n\n\n"], "messages": [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "Tell me a story"}]}
    with httpx.Client(base_url=shared_stack.base_url) as c:
        r = c.post("/v1/streams", json=native_body)
        assert r.status_code == 200 and r.json()["created"] is False and r.json()["status"] == "done"
        assert c.post("/v1/streams", json={**native_body, "seed": 8}).status_code == 409


def test_responses_stream_resumes_after_any_sequence_number_with_no_gap_and_no_duplicate(shared_stack: SharedStack) -> None:
    client = _client(shared_stack.base_url)
    head: list[ResponseStreamEvent] = []
    with client.responses.create(model="m", input="Tell me a story", max_output_tokens=40, background=True,
                                 stream=True) as stream:
        for event in stream:
            head.append(event)
            if event.type == "response.output_text.delta" and len(head) >= 8:
                break  # the connection drops mid-answer
    assert head[0].type == "response.created"
    rid = head[0].response.id
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=head[-1].sequence_number))
    events = head + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    n_deltas = types.count("response.output_text.delta")
    assert types == ["response.created", "response.queued", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * n_deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    native = _native(shared_stack.base_url, _stream_id(rid))
    assert text == native.text and text
    assert n_deltas == [e.event for e in native.events].count("delta")
    assert isinstance(events[-4], ResponseTextDoneEvent) and isinstance(events[-3], ResponseContentPartDoneEvent)
    assert isinstance(events[-3].part, ResponseOutputText) and isinstance(events[-2], ResponseOutputItemDoneEvent)
    assert isinstance(events[-2].item, ResponseOutputMessage) and isinstance(events[-2].item.content[0], ResponseOutputText)
    assert events[-4].text == events[-3].part.text == events[-2].item.content[0].text == text
    assert isinstance(events[-1], ResponseIncompleteEvent)
    final = events[-1].response
    assert final.id == rid and final.status == "incomplete" and final.output_text == text
    assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage is not None and final.usage.output_tokens == 40

    # The same events on every read, live or replayed: resuming after any N gives exactly what follows N.
    full = list(client.responses.retrieve(rid, stream=True))
    assert _dumps(full) == _dumps(events)
    for n in range(len(full)):
        assert _dumps(list(client.responses.retrieve(rid, stream=True, starting_after=n))) == _dumps(full[n + 1:])

    retrieved = client.responses.retrieve(rid)
    assert retrieved.model_dump() == final.model_dump()


def test_responses_report_completed_on_a_stop_sequence_and_wait_without_background(shared_stack: SharedStack) -> None:
    client = _client(shared_stack.base_url)
    # Stop sequences are not a Responses parameter; rsb takes them from extra_body. These letters end any
    # English-like gibberish well before 200 tokens, so the answer ends with "stop": status completed.
    r = client.responses.create(model="m", input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                                instructions="Answer briefly.", max_output_tokens=200,
                                extra_body={"stop": ["e", "a", "o", "i"], "seed": 3})
    native = _native(shared_stack.base_url, _stream_id(r.id))
    assert native.events[-1].data["finish_reason"] == "stop"
    assert r.status == "completed" and r.output_text == native.text and r.incomplete_details is None
    assert r.usage is not None and r.usage.output_tokens == native.events[-1].data["usage"]["completion_tokens"]
    assert r.completed_at is not None and r.completed_at >= r.created_at
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    last = list(client.responses.retrieve(r.id, stream=True))[-1]
    assert last.type == "response.completed" and last.response.model_dump() == r.model_dump()

    # background without stream: answered at once, then polled. 1,000 tokens take the demo model a few hundred
    # ms: the create answers first even on a warm generator that claims the job at once.
    bg = client.responses.create(model="m", input="Hello", max_output_tokens=1000, background=True)
    assert bg.status in ("queued", "in_progress") and bg.background

    def ended() -> Response | None:
        now = client.responses.retrieve(bg.id)
        return None if now.status in ("queued", "in_progress") else now

    bg = eventually(ended, 60, "the background response ending")
    assert bg.status == "incomplete" and bg.output_text == _native(shared_stack.base_url, _stream_id(bg.id)).text


async def test_the_async_client_streams_chat_and_responses(shared_stack: SharedStack) -> None:
    async with openai.AsyncOpenAI(base_url=f"{shared_stack.base_url}/v1", api_key="unused", max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=24,
                                                                     stream=True)
        chunks = [c async for c in raw.parse()]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == _native(shared_stack.base_url, raw.headers["x-rsb-stream-id"]).text
        assert chunks[-1].choices[0].finish_reason == "length"

        stream = await client.responses.create(model="m", input="Hello", max_output_tokens=24, background=True,
                                               stream=True)
        events = [e async for e in stream]
        assert isinstance(events[0], ResponseCreatedEvent)
        rid = events[0].response.id
        resumed = [e async for e in await client.responses.retrieve(rid, stream=True, starting_after=6)]
        assert _dumps(resumed) == _dumps(events[7:])
        retrieved = await client.responses.retrieve(rid)
        assert retrieved.output_text == _native(shared_stack.base_url, _stream_id(rid)).text


def test_cancel_stops_a_long_generation(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator(model=slow_model)
    client = _client(s.base_url)
    r = client.responses.create(model="m", input="Tell me a long story", max_output_tokens=4000, background=True)
    def some_text() -> Response | None:
        now = client.responses.retrieve(r.id)
        assert now.status in ("queued", "in_progress"), now.status
        return now if now.output_text else None

    r = eventually(some_text, 60, "some text in the response")
    assert isinstance(r.output[0], ResponseOutputMessage)
    assert r.status == "in_progress" and r.output[0].status == "in_progress"

    cancelled = client.responses.cancel(r.id)
    assert isinstance(cancelled.output[0], ResponseOutputMessage)
    assert cancelled.status == "cancelled" and cancelled.output[0].status == "incomplete"
    assert cancelled.usage is not None and 0 < cancelled.usage.output_tokens < 4000
    assert client.responses.retrieve(r.id).model_dump() == cancelled.model_dump()
    assert client.responses.cancel(r.id).model_dump() == cancelled.model_dump()  # idempotent
    native = _native(s.base_url, _stream_id(r.id))
    assert native.events[-1].event == "cancelled" and native.events[-1].data["reason"] == "client"
    assert cancelled.output_text == native.text
    last = list(client.responses.retrieve(r.id, stream=True))[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"

    # A chat stream whose generation is cancelled (here through the native route) ends in an error the SDK
    # raises, after the text generated so far.
    raw = client.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=4000, stream=True)
    sid = raw.headers["x-rsb-stream-id"]
    got = []
    with pytest.raises(openai.APIError) as e:
        for chunk in raw.parse():
            got.append(chunk.choices[0].delta.content or "")
            if len(got) == 5:
                assert httpx.post(f"{s.base_url}/v1/streams/{sid}/cancel").status_code == 202
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "cancelled"
    assert "".join(got) == _native(s.base_url, sid).text


def test_a_failed_generation_is_an_error_for_chat_and_a_failed_response(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator("--max-generation-s", "0.5", model=slow_model)  # every long answer ends in error: deadline
    client = _client(s.base_url, max_retries=2)
    with pytest.raises(openai.APIError) as e:
        list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=4000, stream=True))
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "deadline"
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="m", messages=CHAT, max_tokens=4000)
    assert e.value.status_code == 502 and e.value.response.headers["x-should-retry"] == "false"
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "deadline"
    assert _metrics(s.base_url)["rsb_streams_created_total"] == 2  # the SDK did not retry into a new one

    events = list(client.responses.create(model="m", input="Hi", max_output_tokens=4000, stream=True))
    assert isinstance(events[0], ResponseCreatedEvent)
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    error = events[-1].response.error
    assert error is not None and error.code == "server_error" and error.message.startswith("deadline")
    assert events[-1].response.output_text == _native(s.base_url, _stream_id(events[0].response.id)).text
    assert client.responses.retrieve(events[0].response.id).model_dump() == events[-1].response.model_dump()


def test_a_callers_limits_are_openai_429s_with_retry_after(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.generator()
    # A burst of 2 and a slow refill, to reach the limit in three requests.
    s.consumer("--create-burst", "2", "--create-rate-per-s", "0.01")
    client = _client(s.base_url)
    assert client.chat.completions.create(model="m", messages=CHAT, max_tokens=4).choices[0].message.content
    assert client.responses.create(model="m", input="Hi", max_output_tokens=4).status == "incomplete"  # length
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "rate_limited"
    assert int(e.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError) as e:
        client.responses.create(model="m", input="Hi", max_output_tokens=4)
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "rate_limited"


def test_a_draining_pod_ends_response_streams_for_a_resume_and_chat_streams_with_an_error(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    first, _ = s.consumer()
    _, second_url = s.consumer()
    s.generator(model=slow_model)
    # A long generation holds the only worker, so the two below wait in the queue while the pod drains.
    with s.client() as c:
        blocker = c.post("/v1/streams", json={"prompt": "x", "max_tokens": 3500}).json()["id"]
        # Running before the others come: no queue-position event reaches them while the pod drains.
        wait_status(c, blocker, {"running"})
    client = _client(s.base_url)
    stream = client.responses.create(model="m", input="Tell me a story", max_output_tokens=16, background=True,
                                     stream=True)
    # A streamed chat completion holds its status line until its generator counted the prompt: it waits in the
    # queue for it (created, and tailed) while the pod drains.
    chat_failed: list[BaseException] = []

    def chat() -> None:
        try:
            list(_client(s.base_url, max_retries=0).chat.completions.create(model="m", messages=CHAT, max_tokens=8,
                                                                             stream=True))
        except BaseException as e:
            chat_failed.append(e)

    chatting = threading.Thread(target=chat)
    chatting.start()
    head = [next(stream), next(stream)]
    assert [e.type for e in head] == ["response.created", "response.queued"]
    # Both readers tailing and past their first Redis calls: a drain that lands inside a redis-py call can
    # lose its cancellation on Python 3.11 (asyncio.wait_for), which is the SSE layer's to handle, not ours.
    eventually(lambda: _metrics(s.base_url).get("rsb_connected_readers", 0) >= 2, 10, "both readers tailing")
    # Nothing shows a reader's first Redis calls are over: a deliberate half second for them.
    time.sleep(0.5)
    first.signal(signal.SIGTERM)
    # The pod ends the stream at an event boundary: no exception (the SDK would choke on a bare "retry:"
    # field), no terminal event, so the client knows to resume.
    head += list(stream)
    assert [e.type for e in head] == ["response.created", "response.queued"]
    chatting.join(10)
    # A chat completion cannot be resumed through the SDK: an error, not a silent end (before its status line: 503).
    [failed] = chat_failed
    assert isinstance(failed, openai.APIStatusError) and failed.status_code == 503
    assert isinstance(failed.body, dict) and failed.body["code"] == "shutting_down"
    assert first.wait(10) == 0

    assert httpx.post(f"{second_url}/v1/streams/{blocker}/cancel").status_code == 202
    other = _client(second_url)
    assert isinstance(head[0], ResponseCreatedEvent)
    rid = head[0].response.id
    rest = list(other.responses.retrieve(rid, stream=True, starting_after=head[-1].sequence_number))
    events = head + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == _native(second_url, _stream_id(rid)).text


def test_bad_requests_get_openai_errors_and_create_nothing(shared_stack: SharedStack) -> None:
    client = _client(shared_stack.base_url)
    created = _metrics(shared_stack.base_url).get("rsb_streams_created_total", 0)
    bad_chats: list[tuple[dict[str, Any], str]] = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"messages": CHAT, "temperature": 3}, "temperature"),
        ({"messages": CHAT, "top_p": 1.5}, "top_p"),
        ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"messages": CHAT, "max_completion_tokens": 10**9}, "max_completion_tokens"),
        ({"messages": CHAT, "seed": -1}, "seed"),
        ({"messages": CHAT, "n": 2}, "n"),
        ({"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
        ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"messages": CHAT, "extra_body": {"bogus_param": 1}}, "bogus_param"),
        ({"messages": CHAT, "extra_body": {"presence_penalty": 3}}, "presence_penalty"),
        ({"messages": CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
        ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}}}}},
         "response_format"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]},
         "messages"),
    ]
    for kwargs, param in bad_chats:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="m", stream=stream, **kwargs)
            body = e.value.body
            assert e.value.status_code == 400 and isinstance(body, dict), kwargs
            assert body["param"] == param and body["type"] == "invalid_request_error", (kwargs, body)

    bad_responses: list[tuple[dict[str, Any], str]] = [
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {
            "type": "object", "properties": {"s": {"type": "string", "format": "uri"}}}}}}, "text"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "extra_body": {"bogus_param": 1}}, "bogus_param"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "max_tool_calls": 0}, "max_tool_calls"),
        ({"input": [{"type": "item_reference", "id": "msg_nope"}]}, "input"),
    ]
    for kwargs, param in bad_responses:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.responses.create(model="m", background=True, stream=stream, **kwargs)
            assert isinstance(e.value.body, dict) and e.value.body["param"] == param, (kwargs, e.value.body)

    for rid in ("resp_nope", "resp_" + uuid.uuid4().hex, str(uuid.uuid4())):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid, stream=True)
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel(rid)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")

    with httpx.Client(base_url=shared_stack.base_url) as c:
        for path in ("/v1/chat/completions", "/v1/responses"):
            for body in (b"{not json", b"[1]"):
                r = c.post(path, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
            r = c.post(path, content=b"x" * (2 * 1024 * 1024))
            assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        rid = "resp_" + uuid.uuid4().hex
        assert c.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "-1"}).status_code == 400
        assert c.get(f"/v1/responses/{rid}", params={"stream": "maybe"}).status_code == 400
    assert _metrics(shared_stack.base_url).get("rsb_streams_created_total", 0) == created
    # /v1/models lists the model the generator serves: the name its `started` events carry.
    with httpx.Client(base_url=shared_stack.base_url) as c:
        served = _native(shared_stack.base_url, str(create(c, max_tokens=1).json()["id"]))
    model = served.events[1].data["model"]
    listed = client.models.list().data
    assert "demo" in model and [m.id for m in listed if (m.model_extra or {}).get("root") == m.id] == [model]
    # The aliases the test generator answers to are listed too, each with the model it runs on.
    assert {(m.model_extra or {}).get("root") for m in listed} == {model}
    assert client.models.retrieve(model).id == model


def test_an_idempotency_key_makes_retries_land_on_one_generation(shared_stack: SharedStack) -> None:
    client = _client(shared_stack.base_url, max_retries=2)
    key = {"Idempotency-Key": str(uuid.uuid4())}
    before = _metrics(shared_stack.base_url)

    def added(name: str) -> float:  # since the test began: the stack is shared
        return _metrics(shared_stack.base_url).get(name, 0) - before.get(name, 0)

    first = client.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=8,
                                                             extra_headers=key)
    again = client.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=8, stream=True,
                                                             extra_headers=key)
    assert first.headers["x-rsb-stream-id"] == again.headers["x-rsb-stream-id"]
    text = "".join(c.choices[0].delta.content or "" for c in again.parse() if c.choices)
    assert first.parse().choices[0].message.content == text
    assert added("rsb_streams_created_total") == 1 and added("rsb_creates_replayed_total") == 1
    # The same key with another request: a conflict the SDK must not retry.
    with pytest.raises(openai.ConflictError) as e:
        client.chat.completions.create(model="m", messages=CHAT, max_tokens=9, extra_headers=key)
    assert e.value.response.headers["x-should-retry"] == "false"
    assert added("rsb_streams_created_total") == 1


def test_tenants_see_only_their_own_responses(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    alice_key, alice_entry = new_key("alice")
    bob_key, bob_entry = new_key("bob")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [alice_entry, bob_entry]}))
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys))
    s.generator()
    alice, bob = _client(s.base_url, alice_key), _client(s.base_url, bob_key)
    with pytest.raises(openai.AuthenticationError):
        _client(s.base_url, "alice.wrong").responses.create(model="m", input="x")
    r = alice.responses.create(model="m", input="Hello", max_output_tokens=8)
    assert r.status == "incomplete"
    for call in (lambda: bob.responses.retrieve(r.id), lambda: bob.responses.retrieve(r.id, stream=True),
                 lambda: bob.responses.cancel(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.responses.retrieve(r.id).model_dump() == r.model_dump()
    # One Idempotency-Key, two tenants: two streams, no conflict and nothing shared.
    key = {"Idempotency-Key": "same"}
    a = alice.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=8, extra_headers=key)
    b = bob.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=8, extra_headers=key)
    assert a.headers["x-rsb-stream-id"] != b.headers["x-rsb-stream-id"]
    sid = a.headers["x-rsb-stream-id"]
    bob_http = {"Authorization": f"Bearer {bob_key}"}
    assert httpx.get(f"{s.base_url}/v1/streams/{sid}", headers=bob_http).status_code == 404
    alice_http = {"Authorization": f"Bearer {alice_key}"}
    assert a.parse().choices[0].message.content == _native(s.base_url, sid, alice_http).text


def test_what_rsb_honours_or_echoes_is_accepted_and_shown_back(shared_stack: SharedStack) -> None:
    client = _client(shared_stack.base_url)
    chat = client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, presence_penalty=0.5,
                                          frequency_penalty=-0.5, logit_bias={"5": -100}, user="u-1",
                                          metadata={"k": "v"}, store=False, parallel_tool_calls=False,
                                          safety_identifier="s-1")
    assert chat.choices[0].finish_reason in ("stop", "length")
    resp = client.responses.create(model="m", input="hi", instructions="Be brief.", max_output_tokens=4,
                                   metadata={"case": "echo"}, store=False, user="u-2", parallel_tool_calls=False,
                                   max_tool_calls=3, safety_identifier="s-2", background=True)
    done = client.responses.retrieve(resp.id)
    for r in (resp, done):
        d = r.model_dump()  # the SDK's Response has no `store` attribute; the wire object has it
        assert (d["instructions"], d["metadata"], d["store"], d["user"], d["parallel_tool_calls"],
                d["max_tool_calls"], d["safety_identifier"]) == ("Be brief.", {"case": "echo"}, False, "u-2", False,
                                                                3, "s-2")
    # An earlier response's output item named by reference stands for the item itself.
    done = _ended(client, resp.id)
    [item] = [i for i in done.output if i.type == "message"]
    follow = client.responses.create(model="m", max_output_tokens=2, background=True, input=[
        {"role": "user", "content": "hi"}, {"type": "item_reference", "id": item.id},
        {"role": "user", "content": "and?"}])
    # Two tokens may all be made before the create answers (a busy machine): then it is already "incomplete".
    assert follow.status in ("queued", "in_progress", "completed", "incomplete")


def test_item_references_read_only_the_items_they_name_within_a_bound(stack_factory: StackFactory,
                                                                      redis_server: RedisServer,
                                                                      redis_client: redis.Redis) -> None:
    """Issue 42: 64 item_references in a 4.5 KB request made Redis send 51 MB (every response's stored request read
    back whole). Each of these 64 responses keeps a 120 KB request (its tools, offered with tool_choice none); the
    request naming one item of each reads only their events."""
    s = stack_factory(redis_server.url)
    s.generator()
    s.consumer()
    client = _client(s.base_url)
    tools: Any = [{"type": "function", "name": f"tool_{i}", "description": "d" * 1050,
                   "parameters": {"type": "object", "properties": {}}} for i in range(110)]
    made = [client.responses.create(model="m", input="hi", max_output_tokens=4, background=True, tools=tools,
                                    tool_choice="none") for _ in range(64)]

    def message_of(resp_id: str) -> str | None:
        done = client.responses.retrieve(resp_id)
        if done.status not in ("completed", "incomplete"):
            return None
        [item] = [i for i in done.output if i.type == "message"]
        return item.id

    items = [eventually(functools.partial(message_of, r.id), 60) for r in made]
    held = sum(len(v) for v in (redis_client.hget(f"rsb:{{p0}}:s:{_stream_id(r.id)}:meta", "req") for r in made) if v)
    assert held > 64 * 120_000  # the stored requests a read of the whole response would send
    refs: Any = [{"type": "item_reference", "id": i} for i in items]
    sent = int(redis_client.info("stats")["total_net_output_bytes"])
    follow = client.responses.create(model="m", max_output_tokens=2, background=True,
                                     input=[{"role": "user", "content": "hi"}, *refs])
    read = int(redis_client.info("stats")["total_net_output_bytes"]) - sent
    assert follow.status in ("queued", "in_progress", "completed", "incomplete")
    assert read < 1_000_000, f"Redis sent {read} bytes to resolve 64 references"
    too_many: list[tuple[Any, str]] = [([{"type": "item_reference", "id": items[0]}] * 257, "item_reference"),
                                       ([{"type": "item_reference", "id": f"msg_{uuid.uuid4().hex}"}
                                         for _ in range(65)], "responses")]
    for bad, what in too_many:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="m", input=bad)
        assert what in e.value.message


def test_a_prompt_past_the_context_is_a_400_for_a_completion(shared_stack: SharedStack) -> None:
    """As OpenAI answers it, streamed too: a streamed completion holds its status line until its generator counted
    the prompt. A native create keeps its error event."""
    client = _client(shared_stack.base_url)
    long: list[ChatCompletionMessageParam] = [{"role": "user", "content": "word " * 6000}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=long, max_tokens=4, stream=stream)
        assert isinstance(e.value.body, dict) and e.value.body["code"] == "context_length_exceeded", stream
        assert e.value.response.headers["x-should-retry"] == "false"
    with shared_stack.client() as c:
        sid = create(c, messages=long, max_tokens=4).json()["id"]
        end = read_sse(c, f"/v1/streams/{sid}/events").events[-1]
    assert end.event == "error" and end.data["code"] == "context_length_exceeded"


@pytest.mark.slow
def test_a_streamed_completion_waiting_in_the_queue_gets_its_status_line_and_heartbeats(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """The hold of the status line is bounded by --heartbeat-s: a job no generator serves yet (a queue, a scale from
    zero) answers 200 and heartbeats, not a silent connection a proxy's read timeout would cut."""
    s = stack_factory(redis_server.url)
    _, url = s.consumer("--heartbeat-s", "1")  # no generator: the job stays queued
    body = {"model": "m", "messages": CHAT, "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith("data: ") and orjson.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
        assert next(line for line in lines if line).startswith(":")  # a heartbeat comment, while it waits


def test_logprobs_of_every_text_token(shared_stack: SharedStack) -> None:
    client = _client(shared_stack.base_url)
    done = client.chat.completions.create(model="m", messages=CHAT, max_tokens=12, logprobs=True, top_logprobs=2,
                                          seed=5)
    lp = done.choices[0].logprobs
    assert lp is not None and lp.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp.content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in lp.content)
    streamed = list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=12, logprobs=True,
                                                   stream=True, seed=5))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
              for t in c.choices[0].logprobs.content]
    assert len(tokens) == len(lp.content) and [t.token for t in tokens] == [t.token for t in lp.content]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=CHAT, top_logprobs=2)  # needs logprobs
    # Responses: include message.output_text.logprobs, top_logprobs of each.
    resp = client.responses.create(model="m", input="hi", max_output_tokens=8, include=["message.output_text.logprobs"],
                                   top_logprobs=2, background=True)
    resp = _ended(client, resp.id)
    [part] = [c for item in resp.output if item.type == "message" for c in item.content]
    assert part.type == "output_text" and part.logprobs and all(len(t.top_logprobs) == 2 for t in part.logprobs)
    assert resp.top_logprobs == 2
