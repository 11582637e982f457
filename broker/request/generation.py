"""The generation request: validated once at the edge, stored canonically, read back by the worker.

Besides text, a request may carry OpenAI's typed-output fields: ``tools`` (functions the model may call),
``tool_choice``, ``response_format`` (JSON, or JSON valid against a schema), and messages of role ``tool``
(a call's result) and assistant messages with ``tool_calls``. A schema rsb would have to enforce (a
``json_schema`` response format, or the parameters of the tools a forced ``tool_choice`` allows) must be one
its constrained decoding can enforce (broker.schema.enforceable), else the create is a 400 naming what it cannot
do. Absent fields stay absent in the stored form, so a plain request keeps the hash it always had."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from broker.ascii import parse_uuid
from broker.errors import InvalidRequest
from broker.request import tiers
from broker.request.echo import FIELDS as ECHO_FIELDS
from broker.request.echo import parse_echo
from broker.request.history import History
from broker.request.sampling import DEFAULT as DEFAULT_SAMPLING
from broker.request.sampling import FIELDS as SAMPLING_FIELDS
from broker.request.sampling import SEED, TEMPERATURE, TOP_P, Range, Sampling, parse_sampling
from broker.request.tools import (
    JSON_FORMATS,
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOL_DESCRIPTION_CHARS,
    MAX_TOOLS,
    MAX_TOOLS_BYTES,
    TOOL_CHOICES,
    TOOL_NAME,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
    parse_response_format,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    schema_fragment,
)
from broker.schema.enforceable import check_enforceable, json_depth
from broker.schema.grammar_size import GrammarSize

__all__ = ["JSON_FORMATS", "MAX_TOOLS", "MAX_TOOLS_BYTES", "MAX_TOOL_CALLS", "MAX_TOOL_CALL_ID_CHARS",
           "MAX_TOOL_DESCRIPTION_CHARS", "TOOL_CHOICES", "TOOL_NAME", "GenerationRequest", "Message",
           "RequestLimits", "ResponseFormat", "Tool", "ToolCall", "ToolChoice", "check_body_depth", "check_integer",
           "parse_create_body", "parse_json_object", "parse_stream_id", "prompt_token_bound", "validate_create_body"]

#: Levels a request body may nest (schemas take at most broker.schema.enforceable.MAX_SCHEMA_DEPTH of them). Every body
#: is written back as JSON (stored, hashed, a tool's parameters measured), and orjson refuses to write past 254
#: levels: a ``default`` or ``examples`` nested 1,000 deep in a tool's parameters was a 500 there.
MAX_BODY_DEPTH = 128

ROLES = frozenset({"system", "user", "assistant", "tool"})
_FIELDS = frozenset(
    {"id", "messages", "prompt", "model", "max_tokens", "temperature", "top_p", "seed", "stop",
     "cancel_on_disconnect", "tools", "tool_choice", "response_format", "prompt_cache_key", "service_tier",
     *SAMPLING_FIELDS,
     *ECHO_FIELDS}
)
PROMPT_CACHE_KEY_MAX_CHARS = 256
# How much of a request's start names its chat when nothing else does: its messages up to the first user
# message (the instructions and the opening question: every later turn starts with them), or the first
# characters of a prompt.
_LEADING_PROMPT_CHARS = 512
MODEL_MAX_CHARS = 256
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 128
#: What one create may ask for, unless the settings say otherwise (consumer.settings takes its defaults from here).
MAX_TOKENS = 32768
DEFAULT_MAX_TOKENS = 256
MAX_MESSAGES = 1024
MAX_PROMPT_CHARS = 200_000
#: What a create that sets none samples with.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.95


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one create may ask for (the consumer's settings, narrowed by the caller's API key)."""

    max_tokens: int = MAX_TOKENS
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_messages: int = MAX_MESSAGES
    max_prompt_chars: int = MAX_PROMPT_CHARS


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

    def stored(self) -> dict[str, Any]:
        """The stored form (in the canonical request, and in a conversation's turns)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [[c.id, c.name, c.arguments] for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @classmethod
    def from_stored(cls, m: dict[str, Any]) -> Message:
        return cls(m["role"], m["content"], tuple(ToolCall(*c) for c in m.get("tool_calls", ())),
                   m.get("tool_call_id"))


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
    history: History | None = None
    #: OpenAI's ``prompt_cache_key``: requests sharing it go to the generator holding their prefix.
    prompt_cache_key: str | None = None
    #: Penalties, logit biases and the bound on tool calls (broker.request.sampling).
    sampling: Sampling = DEFAULT_SAMPLING
    #: The tier asked for (broker.request.tiers: a tier, or ``auto``; None: not given). Which tier ran is the stream's.
    service_tier: str | None = None
    #: Fields kept only to be shown back (broker.request.echo): metadata, user, safety_identifier, store.
    echo: tuple[tuple[str, Any], ...] = ()

    def echoed(self, name: str, default: Any = None) -> Any:
        return next((v for k, v in self.echo if k == name), default)

    def affinity(self, tenant: str) -> str:
        """What routes this request to the generator that holds its prompt's prefix (chat-affine claiming):
        a digest of its conversation, else of its ``prompt_cache_key``, else of its leading messages (or the
        start of its prompt), always within ``tenant`` (whom the stream is charged to: Claim.tenant). Scoped
        like the prompt cache itself: were two tenants' equal prefixes routed to one worker, how long a
        probe waited for that worker would tell one tenant what another sent. A digest: nothing a client
        typed reaches a key name."""
        h = self.history
        if h is not None and h.conversation is not None:
            source = f"c:{h.tenant}:{h.conversation}"
        elif self.prompt_cache_key is not None:
            source = f"k:{self.prompt_cache_key}"
        elif self.messages is not None:
            first_user = next((i for i, m in enumerate(self.messages) if m.role == "user"), len(self.messages) - 1)
            source = "m:" + orjson.dumps([m.stored() for m in self.messages[:first_user + 1]]).decode()
        else:
            source = "p:" + (self.prompt or "")[:_LEADING_PROMPT_CHARS]
        return hashlib.blake2b(f"{tenant}\0{source}".encode(), digest_size=12).hexdigest()

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
            "messages": None if self.messages is None else [m.stored() for m in self.messages],
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
                             "parameters": schema_fragment(t.parameters)} for t in self.tools]
        if self.tool_choice is not None:
            doc["tool_choice"] = self.tool_choice.as_openai()
        if self.response_format is not None:
            rf = self.response_format
            doc["response_format"] = {
                "type": rf.type, "name": rf.name, "strict": rf.strict, "description": rf.description,
                "schema": schema_fragment(rf.schema)}
        if self.history is not None:
            doc["history"] = self.history.as_json()
        if self.prompt_cache_key is not None:
            doc["prompt_cache_key"] = self.prompt_cache_key
        if self.service_tier is not None:
            doc["service_tier"] = self.service_tier
        doc.update(self.sampling.stored())
        if self.echo:
            doc["echo"] = dict(self.echo)
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
            messages=None if msgs is None else tuple(Message.from_stored(m) for m in msgs),
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
            history=History.from_json(d["history"]) if d.get("history") is not None else None,
            prompt_cache_key=d.get("prompt_cache_key"),
            service_tier=d.get("service_tier"),
            sampling=Sampling.from_stored(d),
            echo=tuple((d.get("echo") or {}).items()),
        )


def _number(body: dict[str, Any], name: str, default: float, bounds: Range) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not bounds.holds(v):
        raise InvalidRequest.at((name,), f" must be a number between {bounds.lo} and {bounds.hi}")
    return float(v)


def check_integer(v: object, name: str, lo: int, hi: int) -> int | None:
    """``v`` as an integer in [lo, hi] (None stays None); an integral float (7.0) counts, a bool does not."""
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():  # 7.0 is an integer in JSON (and JSON Schema)
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidRequest.at((name,), f" must be an integer between {lo} and {hi}")
    return v


def parse_stream_id(raw: object) -> uuid.UUID:
    """A stream id is a UUID in its canonical text form (any case); anything else is refused."""
    parsed = parse_uuid(raw)
    if parsed is None:
        raise InvalidRequest.at(("id",), " must be a UUID like 123e4567-e89b-12d3-a456-426614174000")
    return parsed


def check_body_depth(body: Any) -> None:
    """Refuse (400) a parsed body nested deeper than MAX_BODY_DEPTH, before anything walks or writes it."""
    if json_depth(body) > MAX_BODY_DEPTH:
        raise InvalidRequest(f"the body nests deeper than {MAX_BODY_DEPTH} levels of objects and arrays")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest("body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    check_body_depth(body)
    return body


def prompt_token_bound(canonical_request: bytes) -> int:
    """An upper bound of a request's prompt tokens, with no tokenizer: the bytes of its canonical form. Every
    token of a byte-level or byte-fallback tokenizer is at least one byte, and the JSON around each message is
    longer than a chat template's markers. What a budget reserves for the prompt (broker.streams.budget), and
    what a generation is charged for it when its engine never learns the real count (an upstream cut off
    before its usage record, or one that reports none)."""
    return len(canonical_request)


def parse_create_body(raw: bytes, limits: RequestLimits) -> tuple[uuid.UUID | None, GenerationRequest]:
    """Validate a ``POST /v1/streams`` body. Raises InvalidRequest with a message a user can act on."""
    return validate_create_body(parse_json_object(raw), limits)


def validate_create_body(body: dict[str, Any], limits: RequestLimits) -> tuple[uuid.UUID | None, GenerationRequest]:
    """Validate a create body already parsed from JSON (every view builds one: the native route's is the
    client's own, the protocol views translate theirs). The one validator of what may be generated."""
    max_messages, max_prompt_chars = limits.max_messages, limits.max_prompt_chars
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}", (unknown[0],))

    sid = None if body.get("id") is None else parse_stream_id(body["id"])

    has_messages, has_prompt = "messages" in body, "prompt" in body
    if has_messages == has_prompt:
        raise InvalidRequest.at(("messages",), " or 'prompt' is required: exactly one of them")
    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise InvalidRequest.at(("prompt",), " must be a string")
        prompt = body["prompt"]
        if len(prompt) > max_prompt_chars:
            raise InvalidRequest.at(("prompt",), f" is longer than {max_prompt_chars} characters")
    else:
        raw_msgs = body["messages"]
        if not isinstance(raw_msgs, list) or not raw_msgs or len(raw_msgs) > max_messages:
            raise InvalidRequest.at(("messages",), f" must be a non-empty list of at most {max_messages} messages")
        messages = tuple(_message(m, i) for i, m in enumerate(raw_msgs))
        if sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in messages) > max_prompt_chars:
            raise InvalidRequest.at(("messages",), f" hold content longer than {max_prompt_chars} characters in all")

    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not 0 < len(model) <= MODEL_MAX_CHARS):
        raise InvalidRequest.at(("model",), f" must be a non-empty string of at most {MODEL_MAX_CHARS} characters")

    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,)
    elif isinstance(stop_raw, list):
        stop = tuple(stop_raw)
    else:
        raise InvalidRequest.at(("stop",), " must be a list of strings")
    if len(stop) > MAX_STOP_SEQUENCES or not all(
        isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop
    ):
        raise InvalidRequest.at(
            ("stop",), f" takes at most {MAX_STOP_SEQUENCES} non-empty strings of at most {MAX_STOP_CHARS} characters")

    cod = body.get("cancel_on_disconnect", False)
    if not isinstance(cod, bool):
        raise InvalidRequest.at(("cancel_on_disconnect",), " must be true or false")

    tools = parse_tools(body.get("tools"))
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    if prompt is not None and (body.get("tools") is not None or body.get("tool_choice") is not None):
        raise InvalidRequest.at(("tools",), " and 'tool_choice' need 'messages' (a chat), not a 'prompt'")
    response_format = parse_response_format(body.get("response_format"))
    if response_format is not None and tool_choice is not None and tool_choice.mode in ("required", "function"):
        raise InvalidRequest.at(("response_format",), " and a 'tool_choice' that forces a call exclude each other: "
                                "the answer is a call, not JSON text")
    if tool_choice is not None and tool_choice.mode in ("required", "function"):
        # The answer is constrained to a call of one of these, with arguments valid against its parameters: one
        # grammar for them all, its size added up over them.
        size = GrammarSize("the tools the forced tool_choice allows (one grammar)")
        for i, tool in enumerate(tools):
            if tool_choice.mode == "required" or tool.name == tool_choice.name:
                if tool.parameters is not None:
                    check_enforceable(tool.parameters, ("tools", i, "function", "parameters"), size)

    cache_key = body.get("prompt_cache_key")
    if cache_key is not None and (not isinstance(cache_key, str)
                                  or not 0 < len(cache_key) <= PROMPT_CACHE_KEY_MAX_CHARS):
        raise InvalidRequest.at(("prompt_cache_key",), f" must be a non-empty string of at most "
                                f"{PROMPT_CACHE_KEY_MAX_CHARS} characters")

    tier = body.get("service_tier")
    if tier is not None and tier not in tiers.REQUESTABLE:
        raise InvalidRequest.at(("service_tier",), f" must be one of {', '.join(tiers.REQUESTABLE)}")

    max_tokens = check_integer(body.get("max_tokens"), "max_tokens", 1, limits.max_tokens)
    return sid, GenerationRequest(
        messages=messages,
        prompt=prompt,
        model=model,
        max_tokens=min(limits.default_max_tokens, limits.max_tokens) if max_tokens is None else max_tokens,
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, TEMPERATURE),
        top_p=_number(body, "top_p", DEFAULT_TOP_P, TOP_P),
        seed=check_integer(body.get("seed"), "seed", int(SEED.lo), int(SEED.hi)),
        stop=stop,
        cancel_on_disconnect=cod,
        tools=tools,
        tool_choice=tool_choice,
        response_format=response_format,
        prompt_cache_key=cache_key,
        service_tier=tier,
        sampling=parse_sampling(body),
        echo=parse_echo(body),
    )


def _message(m: Any, i: int) -> Message:
    at = ("messages", i)
    if not isinstance(m, dict):
        raise InvalidRequest.at(at, " must be an object with 'role' and 'content'")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequest.at((*at, "role"), " must be one of system, user, assistant, tool")
    allowed = {"role", "content", *(("tool_calls",) if role == "assistant" else ()),
               *(("tool_call_id",) if role == "tool" else ())}
    unknown = sorted(set(m) - allowed)
    if unknown:
        raise InvalidRequest.at(at, f": unknown field(s) for a {role} message: {', '.join(unknown)}")
    content = m.get("content")
    calls: tuple[ToolCall, ...] = ()
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = parse_tool_calls(m["tool_calls"], (*at, "tool_calls"))
        if content is None:
            content = ""
    if not isinstance(content, str):
        nullable = " (or null with tool_calls)" if role == "assistant" else ""
        raise InvalidRequest.at((*at, "content"), f" must be a string{nullable}")
    call_id = None
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_TOOL_CALL_ID_CHARS:
            raise InvalidRequest.at((*at, "tool_call_id"), " must be the id of the call answered "
                                    f"(a string of 1 to {MAX_TOOL_CALL_ID_CHARS} characters)")
    return Message(role, content, calls, call_id)
