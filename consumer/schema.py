"""Building blocks of the OpenAPI document (consumer/views/openapi.py and the views' own parts): the shapes every
route shares (errors, JSON and SSE responses, nullable values)."""

from __future__ import annotations

from typing import Any

RETRY_AFTER = {"Retry-After": {"schema": {"type": "string", "pattern": "^[0-9]+$"},
                               "description": "seconds to wait before trying again"}}
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["code", "message"],
                             "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}},
}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or null (null: the default, as in OpenAI's API)."""
    return {"anyOf": [schema, {"type": "null"}]}


def json_response(description: str, schema: dict[str, Any], headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def error_response(description: str, headers: dict[str, Any] | None = None,
                   schema: dict[str, Any] = ERROR) -> dict[str, Any]:
    return json_response(description, schema, headers)


def sse_response(description: str, event: dict[str, Any]) -> dict[str, Any]:
    """A text/event-stream response; ``event`` is the schema of ONE parsed event (``data``, ``event``, ``id``,
    ``retry``), which OpenAPI 3.1 tools (schemathesis) validate each event against."""
    return {"description": description, "content": {"text/event-stream": {"schema": event}}}


#: top_logprobs needs logprobs: true (OpenAI's rule): a rule between fields, stated by every body that takes them.
LOGPROBS_RULE: dict[str, Any] = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
