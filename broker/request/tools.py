"""The typed-output fields of a create, in OpenAI's shapes: the tools a model may call, the choice among them,
the format of the answer, and the calls an assistant message made; validated here (bounds, names, the JSON
Schemas rsb must enforce: broker.schema.enforceable) with messages a user can act on, for broker.request.generation."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from broker.errors import InvalidRequest, Path
from broker.schema.enforceable import check_enforceable

MAX_TOOLS = 128
MAX_TOOLS_BYTES = 128 * 1024  # every tool's JSON, together
MAX_TOOL_DESCRIPTION_CHARS = 8192
MAX_TOOL_CALLS = 128  # in one assistant message
MAX_TOOL_CALL_ID_CHARS = 256
TOOL_NAME = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")
TOOL_CHOICES = ("auto", "none", "required")
_CHOICES = " must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\"}}"
#: Where a json_schema response format's fields are, and its schema.
_SPEC: Path = ("response_format", "json_schema")
SCHEMA: Path = (*_SPEC, "schema")
#: response_format types that constrain the answer (``text`` is the default: stored as no format at all).
JSON_FORMATS = ("json_object", "json_schema")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made (in an assistant message): ``arguments`` is JSON text, as the model wrote it."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call. ``parameters`` is the JSON Schema of its arguments (None: none)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        if self.strict:
            fn["strict"] = True
        return {"type": "function", "function": fn}

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """The schema its arguments must match (no parameters: an empty object)."""
        if self.parameters is not None:
            return self.parameters
        return {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``mode`` is auto, none, required or function (then ``name`` is the function that must be called)."""

    mode: str
    name: str | None = None

    def as_openai(self) -> str | dict[str, Any]:
        if self.mode == "function":
            return {"type": "function", "function": {"name": self.name}}
        return self.mode


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """``type`` is json_object or json_schema (then ``schema`` is the schema the answer matches)."""

    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool = False
    description: str | None = None

    def as_openai(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        spec: dict[str, Any] = {"name": self.name, "schema": self.schema}
        if self.description is not None:
            spec["description"] = self.description
        if self.strict:
            spec["strict"] = True
        return {"type": "json_schema", "json_schema": spec}


def schema_fragment(schema: dict[str, Any] | None) -> orjson.Fragment | None:
    # Serialized apart, so OPT_SORT_KEYS leaves its key order (the answer's property order) alone.
    return None if schema is None else orjson.Fragment(orjson.dumps(schema))


def parse_tool_calls(raw: Any, at: Path) -> tuple[ToolCall, ...]:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_TOOL_CALLS:
        raise InvalidRequest.at(at, f" must be a list of 1 to {MAX_TOOL_CALLS} calls")
    calls = []
    for j, c in enumerate(raw):
        where = (*at, j)
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(c, dict) or set(c) - {"id", "type", "function"} or c.get("type", "function") != "function" \
                or not isinstance(fn, dict) or set(fn) - {"name", "arguments"}:
            raise InvalidRequest.at(where, " must be {\"id\", \"type\": \"function\", \"function\": "
                                    "{\"name\", \"arguments\"}}")
        cid = c.get("id")
        if not isinstance(cid, str) or not 0 < len(cid) <= MAX_TOOL_CALL_ID_CHARS:
            raise InvalidRequest.at((*where, "id"), f" must be a string of 1 to {MAX_TOOL_CALL_ID_CHARS} characters")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise InvalidRequest.at((*where, "function", "name"), f" must match {TOOL_NAME.pattern[2:-2]}")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            raise InvalidRequest.at((*where, "function", "arguments"), " must be a string (JSON text)")
        calls.append(ToolCall(cid, name, args))
    return tuple(calls)


def parse_tools(raw: Any) -> tuple[Tool, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise InvalidRequest.at(("tools",), f" must be a list of at most {MAX_TOOLS} tools")
    size = len(orjson.dumps(raw))
    if size > MAX_TOOLS_BYTES:
        raise InvalidRequest.at(("tools",), f" is {size} bytes of JSON; at most {MAX_TOOLS_BYTES} are accepted")
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        at = ("tools", i)
        fn_at = (*at, "function")
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or set(t) - {"type", "function"} or t.get("type") != "function" \
                or not isinstance(fn, dict):
            raise InvalidRequest.at(at, " must be {\"type\": \"function\", \"function\": {\"name\", ...}}")
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise InvalidRequest.at(fn_at, f": unknown field(s): {', '.join(unknown)}")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise InvalidRequest.at((*fn_at, "name"), f" must match {TOOL_NAME.pattern[2:-2]} (letters, digits, _ and "
                                    "-, at most 64)")
        desc = fn.get("description")
        if desc is not None and (not isinstance(desc, str) or len(desc) > MAX_TOOL_DESCRIPTION_CHARS):
            raise InvalidRequest.at((*fn_at, "description"), " must be a string of at most "
                                    f"{MAX_TOOL_DESCRIPTION_CHARS} characters")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type") != "object"):
            raise InvalidRequest.at((*fn_at, "parameters"), " must be a JSON Schema of an object "
                                    "({\"type\": \"object\", \"properties\": ...})")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest.at((*fn_at, "strict"), " must be true or false")
        tools.append(Tool(name, desc, params, bool(strict)))
    return tuple(tools)


def parse_tool_choice(raw: Any, tools: tuple[Tool, ...]) -> ToolChoice | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise InvalidRequest.at(("tool_choice",), _CHOICES)
        choice = ToolChoice(raw)
    else:
        fn = raw.get("function") if isinstance(raw, dict) else None
        if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or set(raw) - {"type", "function"} or set(fn) - {"name"}:
            raise InvalidRequest.at(("tool_choice",), _CHOICES)
        if not any(t.name == fn["name"] for t in tools):
            raise InvalidRequest.at(("tool_choice",), f" names {fn['name'][:64]!r}, which is not one of 'tools'")
        choice = ToolChoice("function", fn["name"])
    if choice.mode == "required" and not tools:
        raise InvalidRequest.at(("tool_choice",), " required needs 'tools'")
    # The defaults are stored as no choice at all: auto with tools, none (nothing to call) without.
    if (choice.mode == "auto" and tools) or (choice.mode in ("auto", "none") and not tools):
        return None
    return choice


def parse_response_format(raw: Any) -> ResponseFormat | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("text", *JSON_FORMATS):
        raise InvalidRequest.at(("response_format",), " must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}")
    assert isinstance(raw, dict)
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    if set(raw) - allowed:
        raise InvalidRequest.at(("response_format",), f": unknown field(s): {', '.join(sorted(set(raw) - allowed))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    spec = raw.get("json_schema")
    if not isinstance(spec, dict) or set(spec) - {"name", "schema", "strict", "description"}:
        raise InvalidRequest.at(_SPEC, " must be {\"name\", \"schema\", \"strict\"?, \"description\"?}")
    name = spec.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise InvalidRequest.at((*_SPEC, "name"), f" must match {TOOL_NAME.pattern[2:-2]}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest.at((*_SPEC, "strict"), " must be true or false")
    desc = spec.get("description")
    if desc is not None and (not isinstance(desc, str) or len(desc) > MAX_TOOL_DESCRIPTION_CHARS):
        raise InvalidRequest.at((*_SPEC, "description"), " must be a string of at most "
                                f"{MAX_TOOL_DESCRIPTION_CHARS} characters")
    if "schema" not in spec:
        raise InvalidRequest.at(SCHEMA, " is required")
    check_enforceable(spec["schema"], SCHEMA)
    return ResponseFormat("json_schema", name, spec["schema"], bool(strict), desc)
