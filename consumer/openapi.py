"""The OpenAPI 3.1 description of the native API, served at ``/openapi.json``.

Written by hand next to the routes so it says exactly what the contract says; the test suite runs
schemathesis against it (every route, many generated examples: no 5xx, every response conforms)."""

from __future__ import annotations

from typing import Any

from broker.request import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, RequestLimits

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["code", "message"],
                             "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}},
}
_RETRY_AFTER = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds to wait"}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens"],
          "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                         "ttft_ms": {"type": ["number", "null"]}, "tpot_ms": {"type": ["number", "null"]}}}
# One server-sent event: an opaque increasing id, a type, and one line of JSON whose shape depends on the
# type (docs/protocol.md lists them).
_EVENT_DATA = {
    "type": "object",
    "required": ["id", "event", "data"],
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9]+-[0-9]+$"},
        "event": {"type": "string",
                  "enum": ["queued", "started", "progress", "delta", "done", "cancelled", "error"]},
        "data": {"type": "string", "contentMediaType": "application/json"},
    },
}
# An event id as issued (empty: from the start); anything else is answered 400.
_RESUME_ID = {"type": "string", "pattern": "^([0-9]{1,19}-[0-9]{1,19})?$"}
# Unix seconds, an RFC 3339 date-time or a date (empty: no bound).
_TIME = {"anyOf": [{"type": "string", "pattern": "^([0-9]{1,12}(\\.[0-9]{1,9})?)?$"},
                   {"type": "string", "format": "date-time"}, {"type": "string", "format": "date"}]}
_STATUS = {"type": "string", "enum": ["queued", "running", "done", "cancelled", "error"]}
_STREAM_ID = {"name": "stream_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}}


def _err(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": _ERROR}}}
    if headers:
        out["headers"] = headers
    return out


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_CREATED = {
    "type": "object",
    "required": ["id", "status", "events_url", "created"],
    "properties": {"id": {"type": "string", "format": "uuid"}, "status": _STATUS,
                   "events_url": {"type": "string"}, "created": {"type": "boolean"},
                   "read_token": {"type": "string"}},
}
_CREATE_BODY: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["role", "content"],
            "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]},
                           "content": {"type": "string"}}}},
        "prompt": {"type": "string"},
        "model": {"type": "string", "minLength": 1, "maxLength": 256},
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},
        "stop": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                           {"type": "array", "maxItems": MAX_STOP_SEQUENCES,
                            "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}}]},
        "cancel_on_disconnect": {"type": "boolean"},
    },
    "oneOf": [{"required": ["messages"]}, {"required": ["prompt"]}],
}
_COUNTERS = {"streams": {"type": "integer"}, "prompt_tokens": {"type": "integer"},
             "completion_tokens": {"type": "integer"}, "tokens_saved": {"type": "integer"},
             "compute_s": {"type": "number"}}
_REPORT = {"type": "object", "required": ["rows", "total"], "properties": {
    "group_by": {"type": "string"}, "since": {"type": ["number", "null"]}, "until": {"type": ["number", "null"]},
    "rows": {"type": "array", "items": {"type": "object", "properties": _COUNTERS}},
    "total": {"type": "object", "properties": _COUNTERS}}}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _create_body(max_tokens: int, max_messages: int, max_prompt_chars: int) -> dict[str, Any]:
    body: dict[str, Any] = {**_CREATE_BODY, "properties": dict(_CREATE_BODY["properties"])}
    props = body["properties"]
    props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": max_tokens}
    props["prompt"] = {"type": "string", "maxLength": max_prompt_chars}
    props["messages"] = {**props["messages"], "maxItems": max_messages}
    # Optional settings may be null, meaning "the default" (as in OpenAI's API).
    for name in ("id", "model", "max_tokens", "temperature", "top_p", "seed", "stop"):
        props[name] = _nullable(props[name])
    return body


_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}


def _openai_paths(common: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI-compatible views (consumer/openai_*.py). Bodies follow OpenAI's API reference; rsb
    refuses (400) what it cannot honour (tools, n > 1, logprobs, non-text parts)."""
    err = {"description": "an error in OpenAI's shape", "content": {"application/json": {"schema": _OPENAI_ERROR}}}
    json_or_sse = {"application/json": {"schema": {"type": "object"}},
                   "text/event-stream": {"schema": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
                              "content": {"type": "string"}}}
    chat_body = {"type": "object", "required": ["messages"], "properties": {
        "model": {"type": "string"}, "messages": {"type": "array", "minItems": 1, "items": message},
        "max_tokens": {"type": "integer", "minimum": 1}, "max_completion_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "top_p": {"type": "number"},
        "seed": {"type": "integer"}, "stop": {"anyOf": [{"type": "string"}, {"type": "array"}]},
        "stream": {"type": "boolean"}, "stream_options": {"type": "object"}}}
    responses_body = {"type": "object", "required": ["input"], "properties": {
        "model": {"type": "string"}, "input": {"anyOf": [{"type": "string"}, {"type": "array"}]},
        "instructions": {"type": "string"}, "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number"}, "top_p": {"type": "number"}, "background": {"type": "boolean"},
        "stream": {"type": "boolean"}}}
    rid = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    errors = {"400": err, "404": err, "409": err, "429": err, "503": err, **common}
    return {
        "/v1/chat/completions": {"post": {
            "operationId": "openaiChatCompletions", "summary": "OpenAI chat.completions (a view of an rsb stream)",
            "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False,
                            "schema": {"type": "string"}}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": chat_body}}},
            "responses": {"200": {"description": "chat.completion, or chat.completion.chunk events when "
                                                 "stream is true", "content": json_or_sse}, **errors}}},
        "/v1/responses": {"post": {
            "operationId": "openaiCreateResponse", "summary": "OpenAI Responses (background mode supported)",
            "requestBody": {"required": True, "content": {"application/json": {"schema": responses_body}}},
            "responses": {"200": {"description": "a response object, or its events when stream is true",
                                  "content": json_or_sse}, **errors}}},
        "/v1/responses/{response_id}": {"get": {
            "operationId": "openaiRetrieveResponse",
            "parameters": [rid, {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
                           {"name": "starting_after", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": -1}}],
            "responses": {"200": {"description": "the response, or its events after starting_after",
                                  "content": json_or_sse}, **errors}}},
        "/v1/responses/{response_id}/cancel": {"post": {
            "operationId": "openaiCancelResponse", "parameters": [rid],
            "responses": {"200": {"description": "the response, cancelled",
                                  "content": {"application/json": {"schema": {"type": "object"}}}}, **errors}}},
        "/v1/models": {"get": {"operationId": "openaiModels", "responses": {
            "200": {"description": "the models this deployment serves",
                    "content": {"application/json": {"schema": {"type": "object"}}}}, **common}}},
    }


def build_openapi(auth: bool, limits: RequestLimits) -> dict[str, Any]:
    """The spec, with this deployment's limits (so generated valid requests are really accepted)."""
    create_body = _create_body(limits.max_tokens, limits.max_messages, limits.max_prompt_chars)
    common = {"401": _err("missing or invalid API key")} if auth else {}
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "rsb", "version": "1", "description": "Resumable streams for LLM generation."},
        "paths": {
            "/v1/streams": {"post": {
                "operationId": "createStream",
                "summary": "Start a generation (idempotent by id)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": create_body}}},
                "responses": {
                    "201": _json("a new stream; one generation enqueued", _CREATED),
                    "200": _json("this id exists with an identical request", _CREATED),
                    "400": _err("invalid request"), "409": _err("this id exists with a different request"),
                    "410": _err("this id belonged to a stream that expired"), "413": _err("body too large"),
                    "429": _err("the queue is full (queue_full), or the caller's share is used "
                                "(too_many_generations, rate_limited)", _RETRY_AFTER),
                    "503": _err("Redis unreachable, or too many connections (too_many_connections, overloaded)",
                                _RETRY_AFTER),
                    **common}}},
            "/v1/streams/{stream_id}/events": {"get": {
                "operationId": "streamEvents",
                "summary": "Replay after the resume point, then tail live (SSE)",
                "parameters": [
                    _STREAM_ID,
                    {"name": "last_event_id", "in": "query", "required": False, "schema": _RESUME_ID},
                    {"name": "Last-Event-ID", "in": "header", "required": False, "schema": _RESUME_ID},
                    {"name": "token", "in": "query", "required": False, "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": {"description": "the events, as server-sent events (`id`, `event`, `data`: one line "
                                           "of JSON; see the protocol docs for each type's data)",
                            "content": {"text/event-stream": {"schema": _EVENT_DATA}}},
                    "204": {"description": "the resume point is the terminal event"},
                    "400": _err("malformed resume id"), "404": _err("unknown stream"),
                    "410": _err("expired"), "429": _err("too many open streams", _RETRY_AFTER),
                    "503": _err("Redis unreachable", _RETRY_AFTER), **common}}},
            "/v1/streams/{stream_id}": {"get": {
                "operationId": "streamStatus",
                "parameters": [_STREAM_ID,
                               {"name": "token", "in": "query", "required": False, "schema": {"type": "string"}}],
                "responses": {
                    "200": _json("the stream's status", {"type": "object",
                                                         "required": ["id", "status", "model", "created_at"],
                                                         "properties": {"id": {"type": "string"}, "status": _STATUS,
                                                                        "model": {"type": "string"},
                                                                        "created_at": {"type": "string"},
                                                                        "usage": _USAGE}}),
                    "404": _err("unknown stream"), "410": _err("expired"),
                    "503": _err("Redis unreachable", _RETRY_AFTER), **common}}},
            "/v1/streams/{stream_id}/cancel": {"post": {
                "operationId": "cancelStream",
                "parameters": [_STREAM_ID],
                "responses": {
                    "202": _json("cancel requested (or the stream had already ended)",
                                 {"type": "object", "required": ["id", "status"],
                                  "properties": {"id": {"type": "string"}, "status": _STATUS}}),
                    "404": _err("unknown stream"), "410": _err("expired"),
                    "503": _err("Redis unreachable", _RETRY_AFTER), **common}}},
            "/v1/reports/aborted": {"get": {
                "operationId": "abortedReport",
                "parameters": [
                    {"name": "since", "in": "query", "required": False, "schema": _TIME},
                    {"name": "until", "in": "query", "required": False, "schema": _TIME},
                    {"name": "group_by", "in": "query", "required": False,
                     "schema": {"type": "string", "enum": ["reason", "model", "day"]}},
                ],
                "responses": {"200": _json("aggregated aborted generations", _REPORT),
                              "400": _err("invalid range or grouping"),
                              "503": _err("Redis unreachable", _RETRY_AFTER), **common}}},
            "/healthz": {"get": {"operationId": "healthz",
                                 "responses": {"200": _json("the process is up", {"type": "object"})}}},
            "/readyz": {"get": {"operationId": "readyz",
                                "responses": {"200": _json("Redis is reachable", {"type": "object"}),
                                              "503": _err("Redis unreachable", _RETRY_AFTER)}}},
            "/metrics": {"get": {"operationId": "metrics", "responses": {
                "200": {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}},
                "503": _err("Redis unreachable", _RETRY_AFTER)}}},
        },
    }
    spec["paths"].update(_openai_paths(common))
    if auth:
        spec["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
        spec["security"] = [{"bearer": []}]
    return spec
