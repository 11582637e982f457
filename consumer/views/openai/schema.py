"""The OpenAPI description of the OpenAI-compatible views, built from the rules the views validate with
(their ``RESTRICTIONS``, roles and content parts, and the generation settings rsb itself validates), so the
document and the code cannot say different things. Bodies follow OpenAI's API reference; what rsb
cannot honour is described as refused.

Typed output (``tools``, ``tool_choice``, ``response_format`` / ``text.format``, tool messages and function call
items) is described in words, not in the request schemas: whether such a request is accepted depends on more
than JSON Schema can say (a tool message must answer an earlier call, a named tool choice must name one of the
tools, a schema must be one rsb can enforce), and the test suite fuzzes the document with checks that every
request it allows is accepted. The responses' schemas do describe the tool calls and reasoning they carry."""

from __future__ import annotations

from typing import Any

from broker.request.generation import RequestLimits
from consumer.schema import LOGPROBS_RULE, RETRY_AFTER, error_response, json_response, nullable, sse_response
from consumer.views.idempotency import HEADER as IDEMPOTENCY_HEADER
from consumer.views.idempotency import MAX_CHARS as MAX_IDEMPOTENCY_KEY
from consumer.views.openai import chat, responses
from consumer.views.openai.common import ROLES, STREAM_ID_HEADER
from consumer.views.openai.conversation_schema import conversation_paths
from consumer.views.openai.input_items import INPUT_TEXT_PARTS

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_STREAM_ID = {STREAM_ID_HEADER: {"schema": {"type": "string", "format": "uuid"},
                                 "description": "the rsb stream behind this object (resume it at "
                                                "/v1/streams/{id}/events)"}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                         "total_tokens": {"type": "integer"},
                         "prompt_tokens_details": {"type": "object",
                                                   "properties": {"cached_tokens": {"type": "integer"}}}}}
_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": _USAGE,
    "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
        "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
            "index": {"const": 0}, "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
            "message": {"type": "object", "required": ["role", "content"], "properties": {
                "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                "reasoning_content": {"type": "string"},
                "tool_calls": {"type": "array", "items": {
                    "type": "object", "required": ["id", "type", "function"], "properties": {
                        "id": {"type": "string"}, "type": {"const": "function"},
                        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                            "name": {"type": "string"}, "arguments": {"type": "string"}}}}}}}}}}}}}
# One event of a streamed chat completion: a chat.completion.chunk, a mid-stream error, or [DONE] (OpenAI
# names no event type: EventSource calls it "message").
_CHAT_EVENT = {"type": "object", "required": ["data"], "properties": {
    "event": {"const": "message"},
    "data": {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json"}]}}}
_RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "output", "model"], "properties": {
    "id": {"type": "string", "pattern": "^resp_[0-9a-f]{32}$"}, "object": {"const": "response"},
    "created_at": {"type": "integer"}, "model": {"type": "string"}, "background": {"const": True},
    "status": {"enum": ["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]},
    "output": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["message", "reasoning", "function_call"]}}}},
    "usage": nullable({"type": "object"})}}
# One event of a response's stream: its type as the SSE event name, the event object as its data.
_RESPONSE_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"enum": list(responses.EVENT_TYPES)},
    "data": {"type": "string", "contentMediaType": "application/json"}}}
_MODEL = {"type": "object", "required": ["id", "object"],
          "properties": {"id": {"type": "string"}, "object": {"const": "model"}}}
_RESPONSE_LINKS = {name: {"operationId": op, "parameters": {"response_id": "$response.body#/id"}}
                   for name, op in (("retrieve", "openaiRetrieveResponse"), ("cancel", "openaiCancelResponse"))}


def _content(limits: RequestLimits, part_types: frozenset[str]) -> dict[str, Any]:
    """A message's content: a string, or a list of text parts (their texts are joined)."""
    text = {"type": "string", "maxLength": limits.max_prompt_chars}
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": sorted(part_types)}, "text": text}}
    return {"anyOf": [text, {"type": "array", "items": part}]}


_CHAT_TYPED = ("Also accepted, in OpenAI's shapes and validated as rsb's create fields (docs/protocol.md): "
               "`tools`, `tool_choice`, `response_format` (text, json_object, json_schema), `service_tier`, messages "
               "of role `tool` "
               "(`tool_call_id`, `content`) answering an earlier assistant message's `tool_calls`.")
_RESPONSES_TYPED = ("Also accepted, in OpenAI's shapes (docs/protocol.md): function `tools`, `tool_choice`, "
                    "`text.format` (text, json_object, json_schema), `service_tier`, and input items of type "
                    "`function_call`, `function_call_output` (answering an earlier call, here or in the history), "
                    "`item_reference` (an earlier response's output item) and `reasoning` (dropped).")


def _chat_body(limits: RequestLimits, generation: dict[str, Any]) -> dict[str, Any]:
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"enum": sorted(ROLES)}, "content": _content(limits, chat.TEXT_PARTS)}}
    props: dict[str, Any] = {
        "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages, "items": message},
        **{name: generation[name] for name in chat.GENERATION},
        **{name: generation["max_tokens"] for name in chat.TOKEN_LIMITS},
        **{rule.name: rule.schema for rule in chat.RESTRICTIONS},
    }
    return {"type": "object", "required": ["messages"], "properties": props, "additionalProperties": False,
            "allOf": [LOGPROBS_RULE],
            "description": f"the messages' content is at most {limits.max_prompt_chars} characters in all; any other "
                           "parameter is a 400 naming it. " + _CHAT_TYPED}


def _input_item(limits: RequestLimits) -> dict[str, Any]:
    return {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": sorted(ROLES)},
        "content": _content(limits, INPUT_TEXT_PARTS)}}


def _responses_body(limits: RequestLimits, generation: dict[str, Any]) -> dict[str, Any]:
    item = _input_item(limits)
    rules = {rule.name: rule.schema for rule in responses.RESTRICTIONS}
    rules["instructions"] = nullable({"type": "string", "maxLength": limits.max_prompt_chars})
    props: dict[str, Any] = {
        "input": {"anyOf": [{"type": "string", "maxLength": limits.max_prompt_chars},
                            {"type": "array", "minItems": 1, "maxItems": limits.max_messages, "items": item}]},
        "max_output_tokens": generation["max_tokens"],
        **{name: generation[name] for name in responses.PASSED_THROUGH},
        **rules,
    }
    # conversation and previous_response_id: one or the other (both null is neither).
    both = {"required": ["conversation", "previous_response_id"], "properties": {
        "conversation": {"not": {"type": "null"}}, "previous_response_id": {"not": {"type": "null"}}}}
    return {"type": "object", "required": ["input"], "properties": props, "not": both, "additionalProperties": False,
            "description": f"instructions and input are at most {limits.max_prompt_chars} characters in all; any "
                           "other parameter is a 400 naming it. " + _RESPONSES_TYPED}


def openai_paths(limits: RequestLimits, generation: dict[str, Any], auth: bool) -> dict[str, Any]:
    """``generation``: the schemas of the settings passed to rsb's own validation (model, max_tokens, ...)."""

    def err(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
        return error_response(description, headers, _ERROR)

    common = {"401": err("missing or invalid API key")} if auth else {}
    limited = {"429": err("the queue is full, or a limit on connections or generations is reached", RETRY_AFTER),
               "503": err("Redis unreachable, or this server is shutting down", RETRY_AFTER)}
    idempotency = {"name": IDEMPOTENCY_HEADER, "in": "header", "required": False,
                   "schema": {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY}}
    rid = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    completion_or_chunks = {"description": "a chat.completion, or chat.completion.chunk events when stream is true",
                            "headers": _STREAM_ID,
                            "content": {**json_response("", _COMPLETION)["content"],
                                        **sse_response("", _CHAT_EVENT)["content"]}}
    response_or_events = {"description": "the response object, or its events when stream is true",
                          "headers": _STREAM_ID,
                          "content": {**json_response("", _RESPONSE)["content"],
                                      **sse_response("", _RESPONSE_EVENT)["content"]},
                          "links": _RESPONSE_LINKS}
    return {
        "/v1/chat/completions": {"post": {
            "operationId": "openaiChatCompletions", "summary": "OpenAI chat.completions (a view of an rsb stream)",
            "parameters": [idempotency],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": _chat_body(limits, generation)}}},
            "responses": {
                "200": completion_or_chunks,
                "400": err("invalid request, or a parameter rsb cannot honour"),
                "404": err("no generator serves the model it names (model_not_found)"),
                "409": err("the Idempotency-Key was used with another request, or the generation was cancelled"),
                "413": err("body too large"),
                "502": err("the generation failed (the engine, a deadline, lost workers)"),
                **limited, **common}}},
        "/v1/responses": {"post": {
            "operationId": "openaiCreateResponse", "summary": "OpenAI Responses (background mode supported)",
            "parameters": [idempotency],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": _responses_body(limits, generation)}}},
            "responses": {"200": response_or_events, "400": err("invalid request, or a parameter rsb cannot honour"),
                          "404": err("no such conversation, or previous response (or another API key's), or no "
                                     "generator serves the model it names (model_not_found)"),
                          "409": err("the Idempotency-Key was used with another request, or has expired; another "
                                     "response of the conversation runs, or the previous one has not ended; the "
                                     "conversation is full (conversation_full)"),
                          "413": err("body too large"), **limited, **common}}},
        "/v1/responses/{response_id}": {"get": {
            "operationId": "openaiRetrieveResponse",
            "parameters": [rid, {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
                           {"name": "starting_after", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": 0, "maximum": responses.MAX_SEQUENCE_NUMBER}}],
            "responses": {"200": response_or_events, "400": err("invalid stream or starting_after"),
                          "404": err("no response with this id"), **limited, **common}}},
        "/v1/responses/{response_id}/cancel": {"post": {
            "operationId": "openaiCancelResponse", "parameters": [rid],
            "responses": {"200": json_response("the response, as it stands once its generation stopped", _RESPONSE),
                          "404": err("no response with this id"), **limited, **common}}},
        **conversation_paths(_input_item(limits), limits, err, common, limited),
        "/v1/models": {"get": {"operationId": "openaiModels", "responses": {
            "200": json_response("the models this deployment serves", {
                "type": "object", "required": ["object", "data"],
                "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL},
                               "default_model": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                                 "description": "what a create that names no model runs on"},
                               "service_tiers": {"type": "array", "items": {"type": "string"},
                                                 "description": "the tiers the caller's key may choose between"}}}),
            **common}}},
        "/v1/models/{model}": {"get": {
            "operationId": "openaiModel",
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": json_response("the model", _MODEL), "404": err("no such model"), **common}}},
    }
