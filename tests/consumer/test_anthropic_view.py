"""The Messages view's two translations, without processes: a Messages request into rsb's create
(consumer.views.anthropic.request) and a stream's events into Anthropic's events and Message
(consumer.views.anthropic.message). Read through the ``anthropic`` SDK's own accumulator, so the events are the
ones its clients fold."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from broker.events import Event
from broker.request.generation import RequestLimits
from broker.streams.records import StreamStatus
from consumer.views.anthropic.errors import AnthropicError
from consumer.views.anthropic.message import MessageView, message_id, parse_message_id, parse_resume_id
from consumer.views.anthropic.request import parse_messages_request

LIMITS = RequestLimits()
STREAM = uuid.UUID("5b0b7a2e-3b8c-4d7e-9a43-8f1a2b3c4d5e")


def _request(**body: Any) -> Any:
    return parse_messages_request({"model": "m", "max_tokens": 64, **body}, LIMITS)


def test_a_tool_loop_becomes_rsbs_messages() -> None:
    req = _request(system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call it.", "signature": "sig"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
            {"type": "text", "text": "And tomorrow?"}]},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Merci"}],
        tools=[{"name": "get_weather", "input_schema": {"type": "object"}, "eager_input_streaming": True}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["\n\n"])
    gen = req.generation
    assert [m.as_openai() for m in gen.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Merci"}]
    assert gen.tool_choice is not None and gen.tool_choice.mode == "required"
    assert gen.sampling.parallel_tool_calls is False and gen.stop == ("\n\n",)
    assert (req.stream, req.thinking) == (False, False)


@pytest.mark.parametrize(("choice", "mode", "name"), [
    ({"type": "auto"}, None, None), ({"type": "any"}, "required", None), ({"type": "none"}, "none", None),
    ({"type": "tool", "name": "get_weather"}, "function", "get_weather")])
def test_each_tool_choice_is_rsbs(choice: dict[str, Any], mode: str | None, name: str | None) -> None:
    gen = _request(messages=[{"role": "user", "content": "Weather in Paris?"}], tool_choice=choice,
                   tools=[{"name": "get_weather", "input_schema": {"type": "object"}}]).generation
    if mode is None:  # auto: what a request with tools and no choice does
        assert gen.tool_choice is None and gen.tools
    else:
        assert gen.tool_choice is not None and (gen.tool_choice.mode, gen.tool_choice.name) == (mode, name)
    assert gen.sampling.parallel_tool_calls is not False  # only disable_parallel_tool_use turns it off


def test_error_results_thinking_tiers_and_formats() -> None:
    req = _request(stream=True, thinking={"type": "adaptive"}, service_tier="standard_only",
                   metadata={"user_id": "u1"}, messages=[
                       {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": True,
                                                     "content": "no network"}]}],
                   output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})
    gen = req.generation
    assert gen.messages is not None and gen.messages[-1].content == "Error: no network"
    assert (req.stream, req.thinking, gen.service_tier, gen.echoed("user")) == (True, True, "default", "u1")
    assert gen.response_format is not None and gen.response_format.type == "json_schema"
    assert _request(messages=[{"role": "user", "content": "x"}], thinking={"type": "disabled"}).thinking is False
    omitted = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    assert parse_messages_request({"model": "m", "max_tokens": 2048, "messages": [{"role": "user", "content": "x"}],
                                   "thinking": omitted}, LIMITS).thinking is False


@pytest.mark.parametrize(("body", "expected"), [
    ({"max_tokens": None}, "max_tokens: Field required"),
    ({"top_k": 5.5}, "'top_k' must be an integer"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "'document' block"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]}, "citations"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}, {"role": "user", "content": "y"}]},
     "without tool_result blocks"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "input_examples": [{"a": 1}]}]},
     "tools.0.input_examples"),
    ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
     "'nope'"),
    ({"tool_choice": {"type": "any"}}, "tool_choice: 'any' needs 'tools'"),
    ({"cache_control": {"type": "persistent"}}, "cache_control"),
    ({"container": "c1"}, "container: not supported"),
    ({"speed": "fast"}, "speed"),
    ({"metadata": {"user_id": "u", "tenant": "t"}}, "metadata.tenant: Extra inputs"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
])
def test_refusals_name_what_is_wrong(body: dict[str, Any], expected: str) -> None:
    full = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "x"}], **body}
    with pytest.raises(AnthropicError) as e:
        parse_messages_request(full, LIMITS)
    assert e.value.status_code == 400 and expected in e.value.message


def _ev(n: int, type_: str, **data: Any) -> Event:
    return Event(f"1795948061{n:03d}-0", type_, orjson.dumps(data))


CALL_ARGS = ['{"city": ', '"Par', 'is"}']
EVENTS = [_ev(1, "queued", position=1, eta_s=None), _ev(2, "started", model="m"),
          _ev(3, "reasoning", text="Think."), _ev(4, "delta", text="Let me look."),
          _ev(5, "tool_call", index=0, id="call_1", name="get_weather"),
          *(_ev(6 + i, "tool_args", index=0, text=t) for i, t in enumerate(CALL_ARGS)),
          _ev(20, "done", finish_reason="tool_calls",
              usage={"prompt_tokens": 30, "cached_tokens": 10, "completion_tokens": 9})]


def _status() -> StreamStatus:
    return StreamStatus(status="done", model="m", created_at=0.0, usage=None, last_id=None, cancel_on_disconnect=False,
                        max_tokens=64, key_id="", tier="default")


def _fold(thinking: bool, events: list[Event] = EVENTS) -> tuple[MessageView, list[tuple[str, dict[str, Any]]]]:
    view = MessageView(STREAM, _status(), thinking=thinking)
    return view, [pair for ev in events for pair in view.feed(ev)]


def test_the_events_fold_into_the_message_the_sdk_accumulates() -> None:
    view, out = _fold(thinking=True)
    types = [e["type"] for _, e in out]
    assert types == ["message_start", "ping", "content_block_start", "content_block_delta",  # thinking
                     "content_block_stop", "content_block_start", "content_block_delta",  # text
                     "content_block_stop", "content_block_start", *["content_block_delta"] * 3,  # the call
                     "content_block_stop", "message_delta", "message_stop"]
    ids = [i for i, _ in out]
    assert ids[:2] == ["1795948061001-0:0", "1795948061001-0:1"] and len(set(ids)) == len(ids)
    snapshot = None
    bufs: dict[int, bytes] = {}
    for _, e in out:
        if e["type"] != "ping":
            snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)  # type: ignore[arg-type]
    assert snapshot is not None
    message = view.message()
    assert message["content"] == [
        {"type": "thinking", "thinking": "Think.", "signature": ""}, {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]
    accumulated = snapshot.model_dump(exclude_none=True)
    assert accumulated == {k: v for k, v in message.items() if v is not None}
    assert view.message()["usage"] == {"input_tokens": 20, "cache_creation_input_tokens": 0,
                                       "cache_read_input_tokens": 10, "output_tokens": 9, "service_tier": "standard"}
    assert view.message()["stop_reason"] == "tool_use"
    # Without thinking: the same stream, no thinking block, the blocks numbered from 0.
    plain, out = _fold(thinking=False)
    assert [b["type"] for b in plain.message()["content"]] == ["text", "tool_use"]
    assert [e["index"] for _, e in out if e["type"] == "content_block_start"] == [0, 1]


def test_resume_ids_and_message_ids() -> None:
    assert parse_resume_id("1795948061004-0:2") == (1795948061004, 0, 2)
    assert parse_resume_id("1795948061004-0") == (1795948061004, 0, 10**9)  # a native id: after all it made
    for bad in ("", "x", "1-0:", "1-0:a", "1-0:1:2", "0x1-0"):
        assert parse_resume_id(bad) is None
    assert parse_message_id(message_id(STREAM, True)) == (STREAM, True)
    assert parse_message_id(message_id(STREAM, False)) == (STREAM, False)
    assert parse_message_id(f"msg_{STREAM.hex.upper()}") is None and parse_message_id("msg_1") is None


def test_stop_sequences_and_endings_without_an_answer() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    view, out = _fold(False, [_ev(1, "queued"), _ev(2, "delta", text="a"),
                              _ev(3, "done", finish_reason="stop", stop_sequence="END", usage=usage)])
    assert out[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    view, out = _fold(False, [_ev(1, "queued"), _ev(2, "done", finish_reason="length", usage=usage)])
    assert view.message()["stop_reason"] == "max_tokens" and view.message()["content"] == []
    view, out = _fold(False, [_ev(1, "queued"), _ev(2, "delta", text="a"),
                              _ev(3, "error", code="context_length_exceeded", message="too long")])
    assert out[-1][1] == {"type": "error", "error": {"type": "invalid_request_error",
                                                     "message": "context_length_exceeded: too long"}}
    view, out = _fold(False, [_ev(1, "queued"), _ev(2, "cancelled", reason="client")])
    assert out[-1][1]["error"]["type"] == "conflict_error"


def test_what_the_translation_walks_is_bounded_before_it_walks() -> None:
    small = RequestLimits(max_messages=4)
    many = [{"role": "user", "content": "x"}] * 5
    with pytest.raises(AnthropicError, match="at most 4 messages"):
        parse_messages_request({"model": "m", "max_tokens": 8, "messages": many}, small)
    blocks = [{"role": "user", "content": [{"type": "text", "text": "x"}] * 33}]  # 8 per message allowed on average
    with pytest.raises(AnthropicError, match="at most 32 content blocks"):
        parse_messages_request({"model": "m", "max_tokens": 8, "messages": blocks}, small)
    with pytest.raises(AnthropicError, match="at most 128 tools"):
        parse_messages_request({"model": "m", "max_tokens": 8, "messages": many[:1],
                                "tools": [{"name": "f", "input_schema": {"type": "object"}}] * 129}, small)
