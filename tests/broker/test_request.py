"""The create body's typed-output fields (tools, tool_choice, response_format, tool messages, assistant tool
calls): validated with messages a user can act on, stored canonically (the 200/409 rule hashes the stored
form), read back as they were sent."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from broker.errors import InvalidRequest
from broker.request.generation import GenerationRequest, RequestLimits, ToolChoice, validate_create_body

LIMITS = RequestLimits()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


def make(**body: Any) -> GenerationRequest:
    if "prompt" not in body:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return validate_create_body(body, LIMITS)[1]


def test_tools_and_a_tool_history_round_trip_through_the_stored_form() -> None:
    req = make(messages=HISTORY, tools=[WEATHER], tool_choice="required")
    back = GenerationRequest.from_canonical(req.canonical_json())
    assert back == req
    assert [m.as_openai() for m in back.messages or ()] == [
        HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [CALL]}, HISTORY[2]]
    assert back.tools[0].as_openai() == WEATHER
    assert back.tool_choice == ToolChoice("required") and back.forced_tools == back.tools


def test_a_plain_request_is_stored_as_before() -> None:
    """Absent typed fields stay absent, so the hash of a request rsb stored before them is unchanged."""
    stored = orjson.loads(make().canonical_json())
    assert set(stored) == {"messages", "prompt", "model", "max_tokens", "temperature", "top_p", "seed", "stop",
                           "cancel_on_disconnect"}
    assert stored["messages"] == [{"role": "user", "content": "hi"}]


def test_defaults_are_one_request_and_schema_order_is_kept() -> None:
    base = make(tools=[WEATHER])
    assert make(tools=[WEATHER], tool_choice="auto").request_hash() == base.request_hash()
    assert make(response_format={"type": "text"}).request_hash() == make().request_hash()
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    req = make(response_format=fmt)
    back = GenerationRequest.from_canonical(req.canonical_json())
    assert back.response_format is not None and back.response_format.schema is not None
    assert list(back.response_format.schema["properties"]) == ["b", "a"]  # the answer's order
    assert back.response_format.as_openai() == fmt
    swapped = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    other = make(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": swapped,
                                                                         "strict": True}})
    assert other.request_hash() != req.request_hash()


def test_a_named_tool_choice_forces_that_tool() -> None:
    other = {"type": "function", "function": {"name": "other"}}
    req = make(tools=[WEATHER, other], tool_choice={"type": "function", "function": {"name": "other"}})
    assert [t.name for t in req.forced_tools] == ["other"]
    assert req.tools[1].arguments_schema == {"type": "object", "properties": {}, "additionalProperties": False}
    assert make(tools=[WEATHER], tool_choice="none").offers_tools is False


@pytest.mark.parametrize(("body", "message"), [
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, r"tools\[0\].function.name must match"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "name must match"),
    ({"tools": [{"type": "retrieval"}]}, r"tools\[0\] must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "parameters must be a JSON Schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "at most 128 tools"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "'tool_choice' must be auto, none, required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope', which is not one of 'tools'"),
    ({"tool_choice": "required"}, "required needs 'tools'"),
    ({"response_format": {"type": "xml"}}, "'response_format' must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 0.5}}}}}},
     r"response_format.json_schema.schema.properties.n.multipleOf: a multipleOf that is not an integer cannot be "
     r"enforced"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     r"tools\[0\].function.parameters.properties.n.uniqueItems"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "exclude each other"),
    ({"messages": [{"role": "tool", "content": "x"}]}, r"messages\[0\].tool_call_id must be"),
    ({"messages": [{"role": "user", "content": None}]}, r"messages\[0\].content must be a string$"),
    ({"messages": [{"role": "assistant", "content": None}]}, r"content must be a string \(or null with tool_calls\)"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "unknown field.*tool_calls"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": []}]}, "must be a list of 1 to 128 calls"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": {
        "name": "f", "arguments": {"city": "Paris"}}}]}]}, "arguments must be a string"),
    ({"prompt": "hi", "tools": [WEATHER]}, "need 'messages'"),
])
def test_bad_typed_fields_are_a_clear_400(body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        make(**body)


def test_unforced_tools_may_use_keywords_rsb_does_not_enforce() -> None:
    """With tool_choice auto the arguments are not constrained, so their schema is passed on as it is."""
    params = {"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}}
    req = make(tools=[{"type": "function", "function": {"name": "f", "parameters": params}}])
    assert req.tools[0].parameters == params and req.forced_tools == ()


def test_tool_call_arguments_count_toward_the_prompt_budget() -> None:
    big = {**CALL, "function": {"name": "f", "arguments": "x" * 1000}}
    with pytest.raises(InvalidRequest, match="longer than 500 characters"):
        validate_create_body({"messages": [{"role": "assistant", "content": "", "tool_calls": [big]}]},
                             RequestLimits(max_prompt_chars=500))
