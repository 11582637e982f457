"""The generation request: validated once at the edge, stored canonically, read back by the worker."""

from __future__ import annotations

import hashlib
import math
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from broker.errors import InvalidRequest

ROLES = frozenset({"system", "user", "assistant"})
_FIELDS = frozenset(
    {"id", "messages", "prompt", "model", "max_tokens", "temperature", "top_p", "seed", "stop",
     "cancel_on_disconnect"}
)
MODEL_MAX_CHARS = 256
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 128
MAX_MESSAGES = 1024
MAX_PROMPT_CHARS = 200_000


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one create may ask for (the consumer's settings, narrowed by the caller's API key)."""

    max_tokens: int = 32768
    default_max_tokens: int = 256
    max_messages: int = MAX_MESSAGES
    max_prompt_chars: int = MAX_PROMPT_CHARS


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str

    def to_json(self) -> dict[str, Any]:
        """The stored form (in the canonical request, and in a conversation's turns)."""
        return {"role": self.role, "content": self.content}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Message:
        return cls(d["role"], d["content"])


@dataclass(frozen=True, slots=True)
class History:
    """Where a request's leading messages came from, when the server put them there (a conversation's turns,
    or a previous response): set by the server, never read from a client's body. ``messages[:lead]`` are
    this request's own instructions (not carried into later turns), ``messages[lead:start]`` the history the
    server assembled, ``messages[start:]`` what the client sent new. For a conversation's turn, the rest names
    it (broker.streams.conversations): whose it is (``tenant``, the API key id), its ``conversation`` name,
    the conversation's ``version`` and how many turns it held when this one began (``turn``), and the
    client's ids of the new messages (``message_ids``: the AI SDK's UIMessage ids). ``previous``: the stream id
    of the response this one continues (OpenAI's ``previous_response_id``)."""

    lead: int = 0
    start: int = 0
    conversation: str | None = None
    tenant: str = ""
    version: int = 0
    turn: int = 0
    message_ids: tuple[str, ...] = ()
    previous: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"lead": self.lead, "start": self.start, "conversation": self.conversation, "tenant": self.tenant,
                "version": self.version, "turn": self.turn, "message_ids": list(self.message_ids),
                "previous": self.previous}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> History:
        return cls(lead=d["lead"], start=d["start"], conversation=d["conversation"], tenant=d["tenant"],
                   version=d["version"], turn=d["turn"], message_ids=tuple(d["message_ids"]),
                   previous=d["previous"])


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
    history: History | None = None

    def canonical_json(self) -> bytes:
        """The stored form; two requests are 'identical' when these bytes are equal."""
        # ``history`` only when set: the form (and so the hash) of every other request stays what it was.
        extra = {} if self.history is None else {"history": self.history.as_json()}
        return orjson.dumps(
            {**extra,
                "messages": None if self.messages is None
                else [m.to_json() for m in self.messages],
                "prompt": self.prompt,
                "model": self.model,
                "max_tokens": self.max_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "seed": self.seed,
                "stop": list(self.stop),
                "cancel_on_disconnect": self.cancel_on_disconnect,
            },
            option=orjson.OPT_SORT_KEYS,
        )

    def request_hash(self) -> str:
        return hashlib.sha256(self.canonical_json()).hexdigest()

    @classmethod
    def from_canonical(cls, raw: bytes) -> GenerationRequest:
        d = orjson.loads(raw)
        msgs = d["messages"]
        return cls(
            messages=None if msgs is None else tuple(Message.from_json(m) for m in msgs),
            prompt=d["prompt"],
            model=d["model"],
            max_tokens=d["max_tokens"],
            temperature=d["temperature"],
            top_p=d["top_p"],
            seed=d["seed"],
            stop=tuple(d["stop"]),
            cancel_on_disconnect=d["cancel_on_disconnect"],
            history=History.from_json(d["history"]) if d.get("history") is not None else None,
        )


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
        out = []
        for i, m in enumerate(raw_msgs):
            if not isinstance(m, dict) or set(m) - {"role", "content"}:
                raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content'")
            if not isinstance(m.get("role"), str) or m["role"] not in ROLES:
                raise InvalidRequest(f"messages[{i}].role must be one of system, user, assistant")
            if not isinstance(m.get("content"), str):
                raise InvalidRequest(f"messages[{i}].content must be a string")
            out.append(Message(m["role"], m["content"]))
        messages = tuple(out)
        if sum(len(m.content) for m in messages) > max_prompt_chars:
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
    )
