"""The OpenAPI 3.1 description of every route, served at ``/openapi.json``.

Each schema says exactly what the code accepts and sends, with this deployment's limits, and is built
from the same constants as the validation it describes (broker/request/generation.py for the native body; the
views' own rule tables for the OpenAI views, in consumer/views/openai/schema.py). SSE responses describe
one event (what schemathesis validates each parsed event against). The test suite runs schemathesis with
every check over every route (tests/consumer/test_openapi.py)."""

from __future__ import annotations

from typing import Any

from broker.events import EventType
from broker.request import tiers
from broker.request.echo import MAX_ID_CHARS, MAX_METADATA_KEY_CHARS, MAX_METADATA_KEYS, MAX_METADATA_VALUE_CHARS
from broker.request.generation import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOL_DESCRIPTION_CHARS,
    MAX_TOOLS,
    MODEL_MAX_CHARS,
    PROMPT_CACHE_KEY_MAX_CHARS,
    TOOL_CHOICES,
    TOOL_NAME,
    RequestLimits,
)
from broker.request.on_busy import ON_BUSY
from broker.request.sampling import (
    LOGIT_BIAS,
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    PENALTY,
    SEED,
    TEMPERATURE,
    TOP_P,
    Range,
)
from broker.request.sampling import MAX_TOOL_CALLS as MAX_SAMPLED_TOOL_CALLS
from broker.streams.records import STATUSES
from broker.streams.report import GROUP_BYS
from broker.streams.usage_report import FORMATS, GROUP_BY_PATTERN
from broker.streams.usage_report import GROUP_BYS as USAGE_GROUP_BYS
from consumer.schema import LOGPROBS_RULE, RETRY_AFTER, error_response, json_response, nullable, sse_response
from consumer.views.openai.schema import openai_paths

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens"],
          "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                         "cached_tokens": {"type": "integer"}, "ttft_ms": {"type": ["number", "null"]},
                         "tpot_ms": {"type": ["number", "null"]}}}
# One server-sent event: an opaque increasing id, a type, and one line of JSON whose shape depends on the
# type (docs/protocol.md lists them).
_EVENT = {
    "type": "object",
    "required": ["id", "event", "data"],
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9]+-[0-9]+$"},
        "event": {"type": "string", "enum": [t.value for t in EventType]},
        "data": {"type": "string", "contentMediaType": "application/json"},
    },
}
# An event id as issued (empty: from the start); anything else is answered 400.
_RESUME_ID = {"type": "string", "pattern": "^([0-9]{1,19}-[0-9]{1,19})?$"}
# Unix seconds, an RFC 3339 date-time or a date (empty: no bound).
_TIME = {"anyOf": [{"type": "string", "pattern": "^([0-9]{1,12}(\\.[0-9]{1,9})?)?$"},
                   {"type": "string", "format": "date-time"}, {"type": "string", "format": "date"}]}
_STATUS = {"type": "string", "enum": list(STATUSES)}
_STREAM_ID = {"name": "stream_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}}
_CREATED = {
    "type": "object",
    "required": ["id", "status", "events_url", "created"],
    "properties": {"id": {"type": "string", "format": "uuid"}, "status": _STATUS,
                   "events_url": {"type": "string"}, "created": {"type": "boolean"},
                   "read_token": {"type": "string"}},
}
_STATUS_BODY = {"type": "object", "required": ["id", "status", "model", "created_at"],
                "properties": {"id": {"type": "string"}, "status": _STATUS, "model": {"type": "string"},
                               "created_at": {"type": "string"}, "usage": _USAGE}}
_COUNTERS = {"streams": {"type": "integer"}, "prompt_tokens": {"type": "integer"},
             "completion_tokens": {"type": "integer"}, "tokens_saved": {"type": "integer"},
             "compute_s": {"type": "number"}}
_REPORT = {"type": "object", "required": ["rows", "total"], "properties": {
    "group_by": {"type": "string"}, "since": {"type": ["number", "null"]}, "until": {"type": ["number", "null"]},
    "rows": {"type": "array", "items": {"type": "object", "properties": _COUNTERS}},
    "total": {"type": "object", "properties": _COUNTERS}}}
_USAGE_COUNTERS = {"streams": {"type": "integer"}, "prompt_tokens": {"type": "integer"},
                   "cached_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                   "wasted_tokens": {"type": "integer"}, "compute_s": {"type": "number"},
                   "cost_usd": {"type": "number"}, "unpriced_streams": {"type": "integer"}}
_USAGE_REPORT = {"type": "object", "required": ["rows", "total"], "properties": {
    "group_by": {"type": "array", "items": {"type": "string", "enum": list(USAGE_GROUP_BYS)}},
    "since": {"type": ["number", "null"]}, "until": {"type": ["number", "null"]},
    "rows": {"type": "array", "items": {"type": "object", "properties": _USAGE_COUNTERS}},
    "total": {"type": "object", "properties": _USAGE_COUNTERS}}}
# A conversation id: its UUID, or OpenAI's spelling of it (conv_ and its hex).
_CONVERSATION_ID = {"anyOf": [{"type": "string", "format": "uuid"},
                              {"type": "string", "pattern": "^conv_[0-9a-fA-F]{32}$"}]}
_TURNS = {"type": "object", "required": ["id", "created_at", "turns"], "properties": {
    "id": {"type": "string", "format": "uuid"}, "created_at": {"type": "string"},
    "turns": {"type": "array", "items": {"type": "object", "required": ["id", "status", "messages", "output"],
                                         "properties": {"id": {"type": "string", "format": "uuid"},
                                                        "status": {"type": "string"},
                                                        "messages": {"type": "array"},
                                                        "output": {"type": ["object", "null"]}}}}}}
# The native operations a created stream leads to (schemathesis' stateful phase follows them).
_STREAM_LINKS = {name: {"operationId": op, "parameters": {"stream_id": "$response.body#/id"}}
                 for name, op in (("status", "streamStatus"), ("events", "streamEvents"), ("cancel", "cancelStream"))}


def _range(r: Range) -> dict[str, Any]:
    return {"minimum": r.lo, "maximum": r.hi}


def generation_properties(limits: RequestLimits) -> dict[str, Any]:
    """The schemas of the generation settings every view passes to rsb's validation as they are (each may be
    null: the default). The OpenAI views reuse them, so one rule has one description."""
    return {
        "model": nullable({"type": "string", "minLength": 1, "maxLength": MODEL_MAX_CHARS,
                           "description": "a served model or alias (GET /v1/models); none: --default-model, else the "
                           "only model served; another is 404 model_not_found"}),
        "service_tier": nullable({"type": "string", "enum": list(tiers.REQUESTABLE),
                                  "description": "priority before default before flex; auto: the key's tier"}),
        "max_tokens": nullable({"type": "integer", "minimum": 1, "maximum": limits.max_tokens}),
        "temperature": nullable({"type": "number", **_range(TEMPERATURE)}),
        "top_p": nullable({"type": "number", **_range(TOP_P)}),
        "seed": nullable({"type": "integer", **_range(SEED)}),
        "stop": nullable({"anyOf": [
            {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
            {"type": "array", "maxItems": MAX_STOP_SEQUENCES,
             "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}}]}),
        "prompt_cache_key": nullable({"type": "string", "minLength": 1, "maxLength": PROMPT_CACHE_KEY_MAX_CHARS,
                                      "description": "requests sharing it go to the generator that holds their "
                                                     "prompt's prefix (OpenAI's prompt_cache_key)"}),
        **{name: nullable({"type": "number", **_range(PENALTY)}) for name in
           ("presence_penalty", "frequency_penalty")},
        "logit_bias": nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                                "additionalProperties": {"type": "number", **_range(LOGIT_BIAS)},
                                "description": "token ids of the model that runs, and biases added to their logits"}),
        "parallel_tool_calls": nullable({"type": "boolean", "description": "false: at most one call per answer"}),
        "max_tool_calls": nullable({"type": "integer", "minimum": 1, "maximum": MAX_SAMPLED_TOOL_CALLS,
                                    "description": "the answer ends before a call past this many"}),
        "metadata": nullable({"type": "object", "maxProperties": MAX_METADATA_KEYS,
                              "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
                              "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS}}),
        **{name: nullable({"type": "string", "maxLength": MAX_ID_CHARS}) for name in ("user", "safety_identifier")},
        "store": nullable({"type": "boolean", "description": "echoed; rsb keeps every stream for its retention"}),
        "logprobs": nullable({"type": "boolean", "description": "logprobs events: each text token's log-probability"}),
        "top_logprobs": nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS,
                                  "description": "the likeliest tokens in each one's place (needs logprobs)"}),
    }


_NAME = {"type": "string", "pattern": f"^{TOOL_NAME.pattern[2:-2]}$"}


def _message(limits: RequestLimits) -> dict[str, Any]:
    """One message of the native body: text from the system, the user or the assistant; an assistant's tool
    calls (content null or text); a tool's result, naming the call it answers."""
    content = {"type": "string", "maxLength": limits.max_prompt_chars}
    call_id = {"type": "string", "minLength": 1, "maxLength": MAX_TOOL_CALL_ID_CHARS}
    call = {"type": "object", "additionalProperties": False, "required": ["id", "function"], "properties": {
        "id": call_id, "type": {"const": "function"},
        "function": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
            "name": _NAME, "arguments": content}}}}

    def shape(roles: list[str], required: list[str], **props: Any) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": False, "required": ["role", *required],
                "properties": {"role": {"type": "string", "enum": roles}, "content": content, **props}}

    return {"anyOf": [
        shape(["system", "user"], ["content"]),
        shape(["assistant"], ["content"], tool_calls={"type": "null"}),
        shape(["assistant"], ["tool_calls"], content=nullable(content),  # content: absent or null = none
              tool_calls={"type": "array", "minItems": 1, "maxItems": MAX_TOOL_CALLS, "items": call}),
        shape(["tool"], ["content", "tool_call_id"], tool_call_id=call_id),
    ]}


def typed_output_properties() -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``response_format`` in OpenAI's shapes. A JSON Schema rsb must enforce (a
    json_schema format's, the parameters of tools a forced choice allows) must use the keywords constrained
    decoding supports, and a named choice must name one of the tools: rules beyond JSON Schema, which the
    descriptions state."""
    description = nullable({"type": "string", "maxLength": MAX_TOOL_DESCRIPTION_CHARS})
    parameters = {"type": "object", "required": ["type"], "properties": {"type": {"const": "object"}},
                  "description": "a JSON Schema of an object; with a tool_choice that forces a call, only the "
                                 "keywords rsb can enforce (docs/protocol.md)"}
    tool = {"type": "object", "additionalProperties": False, "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
            "name": _NAME, "description": description,
            "parameters": nullable(parameters), "strict": nullable({"type": "boolean"})}}}}
    schema = {"type": "object", "description": "a JSON Schema using only the keywords rsb can enforce "
                                                "(docs/protocol.md); anything else is a 400 naming the keyword"}
    return {
        "tools": nullable({"type": "array", "maxItems": MAX_TOOLS, "items": tool}),
        # The named form, {"type": "function", "function": {"name"}}, is accepted when it names one of the tools:
        # a rule JSON Schema cannot state, so the schema leaves the form out (fuzzed, it names no tool).
        "tool_choice": nullable({"enum": list(TOOL_CHOICES),
                                 "description": 'or {"type": "function", "function": {"name"}} naming one of the '
                                                "tools (docs/protocol.md)"}),
        "response_format": nullable({"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["type"],
             "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "additionalProperties": False, "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "additionalProperties": False, "required": ["name", "schema"],
                                "properties": {"name": _NAME, "schema": schema, "strict": nullable({"type": "boolean"}),
                                               "description": description}}}}]}),
    }


def create_body(limits: RequestLimits) -> dict[str, Any]:
    """``POST /v1/streams``; the prompt limit applies to each text and to all of them together (the sum is
    beyond JSON Schema: the description says it). Typed output's fields are described as far as JSON Schema
    can say them (the rules between fields in ``allOf``); what it cannot say is left out of the schema where
    the fuzzer would otherwise send requests the document allows and rsb refuses (a named tool choice that
    names none of the tools), and said in the descriptions (a schema must use what rsb can enforce)."""
    return {
        "type": "object",
        "additionalProperties": False,
        "description": f"the prompt, or the messages' content in all, is at most {limits.max_prompt_chars} "
                       "characters; tools and tool_choice need messages; a tool_choice that forces a call "
                       "(required, or a function) needs tools and excludes a JSON response_format (docs/protocol.md, "
                       "\"Typed output\")",
        "properties": {
            "id": nullable({"type": "string", "format": "uuid"}),
            "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages, "items": _message(limits)},
            "prompt": {"type": "string", "maxLength": limits.max_prompt_chars},
            **generation_properties(limits),
            "cancel_on_disconnect": {"type": "boolean"},
            "conversation": nullable(_CONVERSATION_ID),
            "on_busy": nullable({"enum": list(ON_BUSY), "description": "what a conversation's turn does while "
                                 "another of it runs: reject (409), interrupt (cancel it; this turn runs next, its "
                                 "partial answer in the history) or enqueue (run after it); default: the key's "
                                 "on_busy, else reject. Without a conversation it changes nothing"}),
            **typed_output_properties(),
        },
        # A conversation's turn takes messages.
        "oneOf": [{"required": ["messages"], "not": {"required": ["prompt"]}},
                  {"required": ["prompt"], "not": {"required": ["messages"]},
                   "properties": {"conversation": {"type": "null"}}}],
        # The rules between fields that JSON Schema can say.
        "allOf": [
            {"if": {"required": ["prompt"]}, "then": {"properties": {"tools": {"type": "null"},
                                                                     "tool_choice": {"type": "null"}}}},
            {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "required"}}},
             "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1},
                                                            "response_format": {"anyOf": [
                                                                {"type": "null"},
                                                                {"properties": {"type": {"const": "text"}}}]}}}},
            LOGPROBS_RULE,
        ],
    }



def _native_paths(limits: RequestLimits, common: dict[str, Any]) -> dict[str, Any]:
    return {
        "/v1/streams": {"post": {
            "operationId": "createStream",
            "summary": "Start a generation (idempotent by id)",
            "requestBody": {"required": True, "content": {"application/json": {"schema": create_body(limits)}}},
            "responses": {
                "201": {**json_response("a new stream; one generation enqueued", _CREATED), "links": _STREAM_LINKS},
                "200": {**json_response("this id exists with an identical request", _CREATED),
                        "links": _STREAM_LINKS},
                "400": error_response("invalid request"),
                "409": error_response("this id exists with a different request; a turn of the conversation runs, "
                                      "or the conversation is full (conversation_full)"),
                "404": error_response("no generator serves the model it names (model_not_found)"),
                "410": error_response("this id belonged to a stream that expired"),
                "413": error_response("body too large"),
                "429": error_response("the queue is full (queue_full), the caller's share is used "
                                      "(too_many_generations, rate_limited, too_many_conversations, storage_quota), "
                                      "a budget of its key or team cannot hold it (budget_exceeded), its webhook "
                                      "events wait for its receiver (webhook_backlog), or its address holds too "
                                      "many connections (too_many_connections)", RETRY_AFTER),
                "503": error_response("Redis unreachable (unavailable), or the pod holds as many connections "
                                      "as it may (overloaded)", RETRY_AFTER), **common}}},
        "/v1/streams/{stream_id}/events": {"get": {
            "operationId": "streamEvents",
            "summary": "Replay after the resume point, then tail live (SSE)",
            "parameters": [
                _STREAM_ID,
                {"name": "last_event_id", "in": "query", "required": False, "schema": _RESUME_ID},
                {"name": "Last-Event-ID", "in": "header", "required": False, "schema": _RESUME_ID},
                {"name": "token", "in": "query", "required": False, "schema": {"type": "string"}},
                {"name": "from", "in": "query", "required": False, "schema": {"enum": ["latest"]},
                 "description": "latest: first a snapshot event (the answer so far), then the events after it; "
                                "with a resume point, a snapshot only where a reset would come"},
            ],
            "responses": {
                "200": sse_response("the events (`id`, `event`, `data`: one line of JSON; see the protocol docs "
                                    "for each type's data)", _EVENT),
                "204": {"description": "the resume point is the terminal event"},
                "400": error_response("malformed resume id"), "404": error_response("unknown stream"),
                "410": error_response("expired"), "429": error_response("too many open streams", RETRY_AFTER),
                "503": error_response("Redis unreachable", RETRY_AFTER), **common}}},
        "/v1/streams/{stream_id}": {"get": {
            "operationId": "streamStatus",
            "parameters": [_STREAM_ID, {"name": "token", "in": "query", "required": False,
                                        "schema": {"type": "string"}}],
            "responses": {
                "200": json_response("the stream's status", _STATUS_BODY),
                "404": error_response("unknown stream"), "410": error_response("expired"),
                "503": error_response("Redis unreachable", RETRY_AFTER), **common}}},
        "/v1/streams/{stream_id}/cancel": {"post": {
            "operationId": "cancelStream",
            "parameters": [_STREAM_ID],
            "responses": {
                "202": json_response("cancel requested (or the stream had already ended)",
                                     {"type": "object", "required": ["id", "status"],
                                      "properties": {"id": {"type": "string"}, "status": _STATUS}}),
                "404": error_response("unknown stream"), "410": error_response("expired"),
                "503": error_response("Redis unreachable", RETRY_AFTER), **common}}},
        "/v1/conversations/{conversation_id}/turns": {"get": {
            "operationId": "conversationTurns",
            "summary": "A conversation's history: every finished turn, then the running one",
            "parameters": [{"name": "conversation_id", "in": "path", "required": True,
                            "schema": _CONVERSATION_ID}],
            "responses": {
                "200": json_response("the conversation's turns", _TURNS),
                "404": error_response("no conversation with this id (or another API key's)"),
                "503": error_response("Redis unreachable", RETRY_AFTER), **common}}},
        "/v1/reports/aborted": {"get": {
            "operationId": "abortedReport",
            "parameters": [
                {"name": "since", "in": "query", "required": False, "schema": _TIME},
                {"name": "until", "in": "query", "required": False, "schema": _TIME},
                {"name": "group_by", "in": "query", "required": False,
                 "schema": {"type": "string", "enum": list(GROUP_BYS)}},
            ],
            "responses": {"200": json_response("aggregated aborted generations", _REPORT),
                          "400": error_response("invalid range or grouping"),
                          "429": error_response("too many reports from this caller (rate_limited)", RETRY_AFTER),
                          "503": error_response("Redis unreachable", RETRY_AFTER), **common}}},
        "/v1/reports/usage": {"get": {
            "operationId": "usageReport",
            "summary": "The usage ledger, grouped: every generation that ended (a key's own; an admin key's, all)",
            "parameters": [
                {"name": "since", "in": "query", "required": False, "schema": _TIME},
                {"name": "until", "in": "query", "required": False, "schema": _TIME},
                {"name": "group_by", "in": "query", "required": False,
                 "schema": {"type": "string", "pattern": GROUP_BY_PATTERN}},
                {"name": "format", "in": "query", "required": False,
                 "schema": {"type": "string", "enum": list(FORMATS)}},
                {"name": "key", "in": "query", "required": False, "schema": {"type": "string"},
                 "description": "one key's records (an admin key's view; another key may name only itself)"},
            ],
            "responses": {"200": {**json_response("aggregated usage", _USAGE_REPORT),
                                  "content": {"application/json": {"schema": _USAGE_REPORT},
                                              "text/csv": {"schema": {"type": "string"}}}},
                          "400": error_response("invalid range, grouping or format"),
                          "404": error_response("a key this caller may not see, or none of the keys file"),
                          "429": error_response("too many reports from this caller (rate_limited)", RETRY_AFTER),
                          "503": error_response("Redis unreachable", RETRY_AFTER), **common}}},
    }


def _operations_paths(auth: bool) -> dict[str, Any]:
    """Probes, this document and the page: open to all, API keys or not (``security: []``); metrics too, unless
    keys are set (then any valid key, or --metrics-token; or --scrape-port, outside this API)."""
    text = {"type": "string"}
    paths: dict[str, Any] = {
        "/healthz": {"get": {"operationId": "healthz",
                             "responses": {"200": json_response("the process is up", {"type": "object"})}}},
        "/readyz": {"get": {"operationId": "readyz",
                            "responses": {"200": json_response(
                                "Redis is reachable (under rsb up: and a generator serves its model)",
                                {"type": "object"}),
                                          "503": error_response("Redis unreachable (code unavailable), or under "
                                                                "rsb up no model served yet (code starting)",
                                                                RETRY_AFTER)}}},
        "/metrics": {"get": {"operationId": "metrics", "responses": {
            "200": {"description": "Prometheus text", "content": {"text/plain": {"schema": text}}},
            "503": error_response("Redis unreachable", RETRY_AFTER)}}},
        "/openapi.json": {"get": {"operationId": "openapi", "responses": {
            "200": json_response("this document", {"type": "object", "required": ["openapi", "paths"]})}}},
        "/": {"get": {"operationId": "chatPage", "summary": "the chat page", "responses": {
            "200": {"description": "HTML", "content": {"text/html": {"schema": text}}}}}},
    }
    for path, item in paths.items():
        for operation in item.values():
            if path == "/metrics" and auth:
                operation["responses"]["401"] = error_response("missing or invalid API key (or metrics token)")
                continue
            operation["security"] = []
    return paths


def build_openapi(auth: bool, limits: RequestLimits) -> dict[str, Any]:
    """The spec, with this deployment's limits (so generated valid requests are really accepted)."""
    common = {"401": error_response("missing or invalid API key")} if auth else {}
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "rsb", "version": "1", "description": "Resumable streams for LLM generation."},
        "paths": {**_native_paths(limits, common), **_operations_paths(auth),
                  **openai_paths(limits, generation_properties(limits), auth)},
    }
    if auth:
        spec["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
        spec["security"] = [{"bearer": []}]
    return spec
