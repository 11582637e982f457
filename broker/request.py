"""The generation request: validated once at the edge, stored canonically, read back by the worker.

Besides text, a request may carry OpenAI's typed-output fields: ``tools`` (functions the model may call),
``tool_choice``, ``response_format`` (JSON, or JSON valid against a schema), and messages of role ``tool``
(a call's result) and assistant messages with ``tool_calls``. A schema rsb would have to enforce (a
``json_schema`` response format, or the parameters of the tools a forced ``tool_choice`` allows) must be one
its constrained decoding can enforce (broker.json_schema), else the create is a 400 naming what it cannot
do. Absent fields stay absent in the stored form, so a plain request keeps the hash it always had."""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from broker.errors import InvalidRequest
from broker.json_schema import check_enforceable

ROLES = frozenset({"system", "user", "assistant", "tool"})
_FIELDS = frozenset(
    {"id", "messages", "prompt", "model", "max_tokens", "temperature", "top_p", "seed", "stop",
     "cancel_on_disconnect", "tools", "tool_choice", "response_format"}
)
MODEL_MAX_CHARS = 256
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 128
MAX_MESSAGES = 1024
MAX_PROMPT_CHARS = 200_000
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 128 * 1024  # every tool's JSON, together
MAX_TOOL_DESCRIPTION_CHARS = 8192
MAX_TOOL_CALLS = 128  # in one assistant message
MAX_TOOL_CALL_ID_CHARS = 256
TOOL_NAME = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")
TOOL_CHOICES = ("auto", "none", "required")
#: response_format types that constrain the answer (``text`` is the default: stored as no format at all).
JSON_FORMATS = ("json_object", "json_schema")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one create may ask for (the consumer's settings, narrowed by the caller's API key)."""

    max_tokens: int = 32768
    default_max_tokens: int = 256
    max_messages: int = MAX_MESSAGES
    max_prompt_chars: int = MAX_PROMPT_CHARS


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made (in an assistant message): ``arguments`` is JSON text, as the model wrote it."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Message:
    """One message. ``content`` is "" for an assistant message that only calls tools (OpenAI's null);
    ``tool_calls`` only on assistant messages; ``tool_call_id`` (the call answered) only on ``tool`` ones."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's shape (what chat templates and OpenAI-compatible servers read)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["content"] = self.content or None
            out["tool_calls"] = [c.as_openai() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def _stored(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [[c.id, c.name, c.arguments] for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @classmethod
    def _from_stored(cls, m: dict[str, Any]) -> Message:
        return cls(m["role"], m["content"], tuple(ToolCall(*c) for c in m.get("tool_calls", ())),
                   m.get("tool_call_id"))


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


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    messages: tuple[Message, ...] | None
    prompt: str | None
    model: str | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    cancel_on_disconnect: bool
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None  # None: OpenAI's default (auto with tools)
    response_format: ResponseFormat | None = None  # None: text

    @property
    def forced_tools(self) -> tuple[Tool, ...]:
        """The tools one of which the answer must call (empty: the answer need not be a call)."""
        choice = self.tool_choice
        if choice is None or choice.mode in ("auto", "none"):
            return ()
        if choice.mode == "function":
            return tuple(t for t in self.tools if t.name == choice.name)
        return self.tools

    @property
    def offers_tools(self) -> bool:
        """The model may call a tool (tools given and tool_choice not none)."""
        return bool(self.tools) and (self.tool_choice is None or self.tool_choice.mode != "none")

    def canonical_json(self) -> bytes:
        """The stored form; two requests are 'identical' when these bytes are equal. Keys are sorted, except
        inside JSON Schemas, whose property order is the order the answer is generated in (so two schemas
        that differ only in order are different requests)."""
        doc: dict[str, Any] = {
            "messages": None if self.messages is None else [m._stored() for m in self.messages],
            "prompt": self.prompt,
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
            "cancel_on_disconnect": self.cancel_on_disconnect,
        }
        if self.tools:
            doc["tools"] = [{"name": t.name, "description": t.description, "strict": t.strict,
                             "parameters": _schema_fragment(t.parameters)} for t in self.tools]
        if self.tool_choice is not None:
            doc["tool_choice"] = self.tool_choice.as_openai()
        if self.response_format is not None:
            rf = self.response_format
            doc["response_format"] = {
                "type": rf.type, "name": rf.name, "strict": rf.strict, "description": rf.description,
                "schema": _schema_fragment(rf.schema)}
        return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)

    def request_hash(self) -> str:
        return hashlib.sha256(self.canonical_json()).hexdigest()

    @classmethod
    def from_canonical(cls, raw: bytes) -> GenerationRequest:
        d = orjson.loads(raw)
        msgs = d["messages"]
        choice = d.get("tool_choice")
        rf = d.get("response_format")
        return cls(
            messages=None if msgs is None else tuple(Message._from_stored(m) for m in msgs),
            prompt=d["prompt"],
            model=d["model"],
            max_tokens=d["max_tokens"],
            temperature=d["temperature"],
            top_p=d["top_p"],
            seed=d["seed"],
            stop=tuple(d["stop"]),
            cancel_on_disconnect=d["cancel_on_disconnect"],
            tools=tuple(Tool(t["name"], t["description"], t["parameters"], t["strict"]) for t in d.get("tools", ())),
            tool_choice=None if choice is None else (
                ToolChoice(choice) if isinstance(choice, str) else ToolChoice("function", choice["function"]["name"])),
            response_format=None if rf is None else ResponseFormat(
                rf["type"], rf["name"], rf["schema"], rf["strict"], rf["description"]),
        )


def _schema_fragment(schema: dict[str, Any] | None) -> orjson.Fragment | None:
    # Serialized apart, so OPT_SORT_KEYS leaves its key order (the answer's property order) alone.
    return None if schema is None else orjson.Fragment(orjson.dumps(schema))


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise InvalidRequest(f"'{name}' must be a number between {lo} and {hi}")
    return float(v)


def _integer(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    return check_integer(body.get(name), name, lo, hi)


def check_integer(v: object, name: str, lo: int, hi: int) -> int | None:
    """``v`` as an integer in [lo, hi] (None stays None); an integral float (7.0) counts, a bool does not."""
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():  # 7.0 is an integer in JSON (and JSON Schema)
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidRequest(f"'{name}' must be an integer between {lo} and {hi}")
    return v


def parse_stream_id(raw: object) -> uuid.UUID:
    """A stream id is a UUID in its canonical text form (any case); anything else is refused."""
    if not isinstance(raw, str) or len(raw) != 36:
        raise InvalidRequest("'id' must be a UUID like 123e4567-e89b-12d3-a456-426614174000")
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise InvalidRequest("'id' must be a UUID like 123e4567-e89b-12d3-a456-426614174000") from None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest("body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    return body


def parse_create_body(raw: bytes, limits: RequestLimits) -> tuple[uuid.UUID | None, GenerationRequest]:
    """Validate a ``POST /v1/streams`` body. Raises InvalidRequest with a message a user can act on."""
    return validate_create_body(parse_json_object(raw), limits)


def validate_create_body(body: dict[str, Any], limits: RequestLimits) -> tuple[uuid.UUID | None, GenerationRequest]:
    """Validate a create body already parsed from JSON (every view builds one: the native route's is the
    client's own, the protocol views translate theirs). The one validator of what may be generated."""
    max_messages, max_prompt_chars = limits.max_messages, limits.max_prompt_chars
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}")

    sid = None if body.get("id") is None else parse_stream_id(body["id"])

    has_messages, has_prompt = "messages" in body, "prompt" in body
    if has_messages == has_prompt:
        raise InvalidRequest("exactly one of 'messages' and 'prompt' is required")
    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise InvalidRequest("'prompt' must be a string")
        prompt = body["prompt"]
        if len(prompt) > max_prompt_chars:
            raise InvalidRequest(f"'prompt' is longer than {max_prompt_chars} characters")
    else:
        raw_msgs = body["messages"]
        if not isinstance(raw_msgs, list) or not raw_msgs or len(raw_msgs) > max_messages:
            raise InvalidRequest(f"'messages' must be a non-empty list of at most {max_messages} messages")
        messages = tuple(_message(m, i) for i, m in enumerate(raw_msgs))
        if sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in messages) > max_prompt_chars:
            raise InvalidRequest(f"the messages' content is longer than {max_prompt_chars} characters in all")

    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not 0 < len(model) <= MODEL_MAX_CHARS):
        raise InvalidRequest(f"'model' must be a non-empty string of at most {MODEL_MAX_CHARS} characters")

    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,)
    elif isinstance(stop_raw, list):
        stop = tuple(stop_raw)
    else:
        raise InvalidRequest("'stop' must be a list of strings")
    if len(stop) > MAX_STOP_SEQUENCES or not all(
        isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop
    ):
        raise InvalidRequest(
            f"'stop' takes at most {MAX_STOP_SEQUENCES} non-empty strings of at most {MAX_STOP_CHARS} characters"
        )

    cod = body.get("cancel_on_disconnect", False)
    if not isinstance(cod, bool):
        raise InvalidRequest("'cancel_on_disconnect' must be true or false")

    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    if prompt is not None and (tools or tool_choice is not None):
        raise InvalidRequest("'tools' and 'tool_choice' need 'messages' (a chat), not a 'prompt'")
    response_format = _response_format(body.get("response_format"))
    if response_format is not None and tool_choice is not None and tool_choice.mode in ("required", "function"):
        raise InvalidRequest("a 'response_format' and a 'tool_choice' that forces a call exclude each other: "
                             "the answer is a call, not JSON text")
    if tool_choice is not None and tool_choice.mode in ("required", "function"):
        # The answer is constrained to a call of one of these, with arguments valid against its parameters.
        for i, tool in enumerate(tools):
            if tool_choice.mode == "required" or tool.name == tool_choice.name:
                if tool.parameters is not None:
                    check_enforceable(tool.parameters, f"tools[{i}].function.parameters")

    max_tokens = _integer(body, "max_tokens", 1, limits.max_tokens)
    return sid, GenerationRequest(
        messages=messages,
        prompt=prompt,
        model=model,
        max_tokens=min(limits.default_max_tokens, limits.max_tokens) if max_tokens is None else max_tokens,
        temperature=_number(body, "temperature", 0.8, 0.0, 2.0),
        top_p=_number(body, "top_p", 0.95, 0.0, 1.0),
        seed=_integer(body, "seed", 0, 2**32 - 1),
        stop=stop,
        cancel_on_disconnect=cod,
        tools=tools,
        tool_choice=tool_choice,
        response_format=response_format,
    )


def _message(m: Any, i: int) -> Message:
    at = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(f"{at} must be an object with 'role' and 'content'")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequest(f"{at}.role must be one of system, user, assistant, tool")
    allowed = {"role", "content", *(("tool_calls",) if role == "assistant" else ()),
               *(("tool_call_id",) if role == "tool" else ())}
    unknown = sorted(set(m) - allowed)
    if unknown:
        raise InvalidRequest(f"{at}: unknown field(s) for a {role} message: {', '.join(unknown)}")
    content = m.get("content")
    calls: tuple[ToolCall, ...] = ()
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = _tool_calls(m["tool_calls"], f"{at}.tool_calls")
        if content is None:
            content = ""
    if not isinstance(content, str):
        nullable = " (or null with tool_calls)" if role == "assistant" else ""
        raise InvalidRequest(f"{at}.content must be a string{nullable}")
    call_id = None
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_TOOL_CALL_ID_CHARS:
            raise InvalidRequest(f"{at}.tool_call_id must be the id of the call answered "
                                 f"(a string of 1 to {MAX_TOOL_CALL_ID_CHARS} characters)")
    return Message(role, content, calls, call_id)


def _tool_calls(raw: Any, at: str) -> tuple[ToolCall, ...]:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_TOOL_CALLS:
        raise InvalidRequest(f"{at} must be a list of 1 to {MAX_TOOL_CALLS} calls")
    calls = []
    for j, c in enumerate(raw):
        where = f"{at}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(c, dict) or set(c) - {"id", "type", "function"} or c.get("type", "function") != "function" \
                or not isinstance(fn, dict) or set(fn) - {"name", "arguments"}:
            raise InvalidRequest(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": "
                                 "{\"name\", \"arguments\"}}")
        cid = c.get("id")
        if not isinstance(cid, str) or not 0 < len(cid) <= MAX_TOOL_CALL_ID_CHARS:
            raise InvalidRequest(f"{where}.id must be a string of 1 to {MAX_TOOL_CALL_ID_CHARS} characters")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise InvalidRequest(f"{where}.function.name must match {TOOL_NAME.pattern[2:-2]}")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            raise InvalidRequest(f"{where}.function.arguments must be a string (JSON text)")
        calls.append(ToolCall(cid, name, args))
    return tuple(calls)


def _tools(raw: Any) -> tuple[Tool, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools")
    size = len(orjson.dumps(raw))
    if size > MAX_TOOLS_BYTES:
        raise InvalidRequest(f"'tools' is {size} bytes of JSON; at most {MAX_TOOLS_BYTES} are accepted")
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        at = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or set(t) - {"type", "function"} or t.get("type") != "function" \
                or not isinstance(fn, dict):
            raise InvalidRequest(f"{at} must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise InvalidRequest(f"{at}.function: unknown field(s): {', '.join(unknown)}")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise InvalidRequest(f"{at}.function.name must match {TOOL_NAME.pattern[2:-2]} (letters, digits, _ and -, "
                                 "at most 64)")
        if any(other.name == name for other in tools):
            raise InvalidRequest(f"{at}.function.name: two tools are called {name!r}")
        desc = fn.get("description")
        if desc is not None and (not isinstance(desc, str) or len(desc) > MAX_TOOL_DESCRIPTION_CHARS):
            raise InvalidRequest(f"{at}.function.description must be a string of at most "
                                 f"{MAX_TOOL_DESCRIPTION_CHARS} characters")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type") != "object"):
            raise InvalidRequest(f"{at}.function.parameters must be a JSON Schema of an object "
                                 "({\"type\": \"object\", \"properties\": ...})")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest(f"{at}.function.strict must be true or false")
        tools.append(Tool(name, desc, params, bool(strict)))
    return tuple(tools)


def _tool_choice(raw: Any, tools: tuple[Tool, ...]) -> ToolChoice | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise InvalidRequest("'tool_choice' must be auto, none, required or {\"type\": \"function\", "
                                 "\"function\": {\"name\"}}")
        choice = ToolChoice(raw)
    else:
        fn = raw.get("function") if isinstance(raw, dict) else None
        if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or set(raw) - {"type", "function"} or set(fn) - {"name"}:
            raise InvalidRequest("'tool_choice' must be auto, none, required or {\"type\": \"function\", "
                                 "\"function\": {\"name\"}}")
        if not any(t.name == fn["name"] for t in tools):
            raise InvalidRequest(f"'tool_choice' names {fn['name'][:64]!r}, which is not one of 'tools'")
        choice = ToolChoice("function", fn["name"])
    if choice.mode == "required" and not tools:
        raise InvalidRequest("'tool_choice' required needs 'tools'")
    # The defaults are stored as no choice at all: auto with tools, none (nothing to call) without.
    if (choice.mode == "auto" and tools) or (choice.mode in ("auto", "none") and not tools):
        return None
    return choice


def _response_format(raw: Any) -> ResponseFormat | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("text", *JSON_FORMATS):
        raise InvalidRequest("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}")
    assert isinstance(raw, dict)
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    if set(raw) - allowed:
        raise InvalidRequest(f"response_format: unknown field(s): {', '.join(sorted(set(raw) - allowed))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    spec = raw.get("json_schema")
    if not isinstance(spec, dict) or set(spec) - {"name", "schema", "strict", "description"}:
        raise InvalidRequest("response_format.json_schema must be {\"name\", \"schema\", \"strict\"?, "
                             "\"description\"?}")
    name = spec.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise InvalidRequest(f"response_format.json_schema.name must match {TOOL_NAME.pattern[2:-2]}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("response_format.json_schema.strict must be true or false")
    desc = spec.get("description")
    if desc is not None and (not isinstance(desc, str) or len(desc) > MAX_TOOL_DESCRIPTION_CHARS):
        raise InvalidRequest(f"response_format.json_schema.description must be a string of at most "
                             f"{MAX_TOOL_DESCRIPTION_CHARS} characters")
    if "schema" not in spec:
        raise InvalidRequest("response_format.json_schema.schema is required")
    check_enforceable(spec["schema"], "response_format.json_schema.schema")
    return ResponseFormat("json_schema", name, spec["schema"], bool(strict), desc)
