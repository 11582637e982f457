"""``POST /v1/chat/completions``: a chat completion is one rsb stream, read as ``chat.completion.chunk``
objects (``stream: true``) or folded into one ``chat.completion`` once it ends.

Typed output streams as OpenAI (and vLLM) stream it: a tool call's first chunk names it (``index``, ``id``,
``type: function``, ``name``), the next ones carry only its ``index`` and a piece of its ``arguments`` (the
SDKs concatenate every string field of a chunk: an id or a name sent twice would be doubled); reasoning is
``delta.reasoning_content``, the field vLLM and DeepSeek send and their clients read.

The generation runs on whether or not this connection stays: the ``x-rsb-stream-id`` response header names
the stream, which ``/v1/streams/{id}/events`` resumes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from broker.errors import InvalidRequest, Path
from broker.events import Event, EventType
from broker.request.generation import RequestLimits, check_integer
from broker.request.tiers import DEFAULT as DEFAULT_TIER
from broker.streams.records import StreamStatus
from consumer.state import caller_of, state_of
from consumer.streaming.service import StreamService
from consumer.streaming.sse import SSEResponse
from consumer.views.openai.common import (
    DONE_FRAME,
    NULL,
    ROLES,
    STREAM_ID_HEADER,
    DeferredResponse,
    Only,
    boolean,
    cached_tokens,
    check_known,
    check_only,
    create_stream,
    data_frame,
    dropped_header,
    error_json,
    invalid,
    no_items,
    null_only,
    read_json,
    text_of,
    unanswered_result,
    usage_tokens,
)

#: The content parts a chat message may carry.
TEXT_PARTS = frozenset({"text"})
# Shutdown mid-stream: an error the SDK raises, instead of an answer silently cut short.
_SHUTDOWN_FRAME = data_frame({"error": {"message": "the server is shutting down; the generation goes on: "
                                        "resume it at /v1/streams/{x-rsb-stream-id}/events",
                                        "type": "server_error", "param": None, "code": "shutting_down"}})


def _is_int(v: object, value: int) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == value


def _stream_options(v: object) -> bool:
    return v is None or (isinstance(v, dict) and (v.get("include_usage") is None
                                                  or isinstance(v.get("include_usage"), bool)))


#: What rsb cannot honour, and the one shape in which each parameter is accepted (the OpenAPI document is
#: built from the same rules). Tools, tool_choice and response_format are rsb's own create fields (OpenAI's
#: shapes), passed through.
RESTRICTIONS = (
    Only("n", {"anyOf": [{"const": 1}, NULL]}, lambda v: v is None or _is_int(v, 1), "only 'n': 1 is supported"),
    no_items("functions"), null_only("function_call"),
    null_only("audio"), null_only("prediction", droppable=True), null_only("web_search_options", droppable=True),
    null_only("reasoning_effort", droppable=True), null_only("verbosity", droppable=True),
    null_only("prompt_cache_retention", droppable=True),
    Only("modalities", {"anyOf": [{"const": ["text"]}, NULL]}, lambda v: v is None or v == ["text"],
         "only the text modality is supported"),
    boolean("stream"),
    Only("stream_options", {"anyOf": [{"type": "object", "properties": {
        "include_usage": {"anyOf": [{"type": "boolean"}, NULL]}}}, NULL]}, _stream_options,
         "'stream_options' must be an object whose include_usage is true or false"),
)
#: The token budget goes by either name (max_tokens is the older one): both are checked, the newer wins.
TOKEN_LIMITS = ("max_completion_tokens", "max_tokens")
#: Passed to rsb's own validation as they are: the generation settings (their schema is the native create
#: body's) and typed output's fields (OpenAI's shapes are rsb's).
GENERATION = ("model", "temperature", "top_p", "seed", "stop", "prompt_cache_key", "presence_penalty",
              "frequency_penalty", "logit_bias", "parallel_tool_calls", "metadata", "user", "safety_identifier",
              "store", "logprobs", "top_logprobs", "service_tier")
TYPED = ("tools", "tool_choice", "response_format")
PASSED_THROUGH = GENERATION + TYPED
#: Every parameter a chat request may carry; any other is a 400 naming it, as OpenAI answers.
KNOWN = frozenset({"messages", *TOKEN_LIMITS, *PASSED_THROUGH, *(r.name for r in RESTRICTIONS)})
#: A chat request's roles, as rsb's: OpenAI's (``developer`` is its newer name for ``system``) and tool results.
CHAT_ROLES = {**ROLES, "tool": "tool"}


def _message(i: int, m: object) -> dict[str, Any]:
    """One chat message as rsb's: text parts joined; an assistant's tool calls and a tool result's call id
    passed on as they are (rsb validates them)."""
    if not isinstance(m, dict):
        raise invalid(f"messages[{i}] must be an object", "messages")
    role = CHAT_ROLES.get(str(m.get("role")))
    if role is None:
        raise invalid(f"messages[{i}].role must be one of system, developer, user, assistant, tool "
                      "(function messages are not supported: use tool)", "messages")
    where, at, content = f"messages[{i}]", ("messages", i), m.get("content")
    if role == "tool":
        return {"role": "tool", "tool_call_id": m.get("tool_call_id"), "content": text_of(content, at, TEXT_PARTS)}
    if role != "assistant":
        return {"role": role, "content": text_of(content, at, TEXT_PARTS)}
    if m.get("function_call") is not None:
        raise invalid(f"{where}.function_call is not supported: send tool_calls", "messages")
    text = None if content is None else text_of(content, at, TEXT_PARTS)
    out: dict[str, Any] = {"role": "assistant", "content": text}
    if m.get("tool_calls"):  # null and [] are what clients send back for "no calls"
        out["tool_calls"] = [_echoed_call(c) for c in m["tool_calls"]] if isinstance(m["tool_calls"], list) \
            else m["tool_calls"]
    return out


def _echoed_call(call: object) -> object:
    """A call as the client sends it back: the SDK's parsed objects carry what they parsed (``parsed_arguments``)
    and the request needs only the call itself."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call  # rsb's validator says what is wrong with it
    fn = call["function"]
    return {**{k: call[k] for k in ("id", "type") if k in call},
            "function": {k: fn[k] for k in ("name", "arguments") if k in fn}}


def _chat_body(body: dict[str, Any], limits: RequestLimits, *, drop: bool = False
               ) -> tuple[dict[str, Any], dict[Path, Path], list[str]]:
    """The rsb create body for a chat request, the renames of rsb's fields for its errors, and the parameters it
    had dropped (``drop``: --drop-unsupported-params)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty list", "messages")
    messages = [_message(i, m) for i, m in enumerate(raw)]
    unanswered = unanswered_result(messages)
    if unanswered is not None:  # OpenAI's rule (chat's messages are the client's, one for one)
        call_id = str(messages[unanswered].get("tool_call_id"))
        raise invalid(f"messages[{unanswered}]: a tool message must answer a call an earlier assistant message made "
                      f"(tool_call_id {call_id[:64]!r} names none)", "messages")
    dropped = check_only(body, RESTRICTIONS, drop=drop)
    check_known(body, KNOWN)
    given = [name for name in TOKEN_LIMITS if body.get(name) is not None]
    for name in given[1:]:  # the older name must be valid too, though the newer one wins
        try:
            check_integer(body[name], name, 1, limits.max_tokens)
        except InvalidRequest as e:
            raise invalid(e.message, name) from None
    rsb: dict[str, Any] = {"messages": messages, "max_tokens": body.get(given[0]) if given else None}
    for name in PASSED_THROUGH:
        if body.get(name) is not None:
            rsb[name] = body[name]
    return rsb, {("max_tokens",): (given[0] if given else "max_completion_tokens",)}, dropped


class _Chat:
    """The fixed fields of every object of one completion."""

    def __init__(self, stream_id: uuid.UUID, st: StreamStatus) -> None:
        self.id = f"chatcmpl-{stream_id.hex}"
        self.created = int(st.created_at)
        # The model that runs it (its queue's: an alias asked for is resolved at create) and the tier it waited in.
        self.model = st.model
        self.service_tier = st.tier or DEFAULT_TIER

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "service_tier": self.service_tier, "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def usage(self, usage: dict[str, Any] | None) -> dict[str, Any]:
        prompt, completion = usage_tokens(usage)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached_tokens(usage)}}


#: Generation errors that are the request's, not the engine's: a non-streamed completion answers them with a 400.
REQUEST_ERRORS = frozenset({"context_length_exceeded", "invalid_request"})


def _terminal_error(ev: Event) -> dict[str, Any]:
    """OpenAI's error object for a stream that ended without an answer: cancelled or failed."""
    data = ev.json()
    if ev.type == EventType.CANCELLED:
        return {"message": f"the generation was cancelled ({data.get('reason', 'client')})",
                "type": "invalid_request_error", "param": None, "code": "cancelled"}
    return {"message": f"the generation failed: {data.get('message', '')}", "type": "server_error",
            "param": None, "code": str(data.get("code", "engine"))}


def _tool_call(data: dict[str, Any]) -> dict[str, Any]:
    """A ``tool_call`` event as the first chunk of a call: its index, id, type and name (no arguments yet)."""
    return {"index": data["index"], "id": data["id"], "type": "function",
            "function": {"name": data["name"], "arguments": ""}}


def _delta(ev: Event) -> dict[str, Any] | None:
    """The chunk delta of one event of the answer (None: the event is not part of the answer)."""
    if ev.type == EventType.DELTA:
        return {"content": ev.json()["text"]}
    if ev.type == EventType.REASONING:
        return {"reasoning_content": ev.json()["text"]}
    if ev.type == EventType.TOOL_CALL:
        return {"tool_calls": [_tool_call(ev.json())]}
    if ev.type == EventType.TOOL_ARGS:
        data = ev.json()
        return {"tool_calls": [{"index": data["index"], "function": {"arguments": data["text"]}}]}
    return None


#: Events before a generator has counted the prompt: a streamed completion holds its status line through them.
_BEFORE_THE_PROMPT = frozenset({EventType.QUEUED, EventType.STARTED})


async def _held(service: StreamService, chat: _Chat, stream_id: uuid.UUID, include_usage: bool,
                make: Callable[[AsyncIterator[bytes | None]], Response]) -> Response:
    """A streamed completion's response once its generator has counted the prompt: at its first event past the
    queue and ``started`` (a token, prefill progress, or the end). OpenAI refuses a prompt past the model's context
    before it streams anything (``400 context_length_exceeded``), and its SDK raises that as a BadRequestError; a
    ``200`` whose stream then carries the error would raise a generic APIError instead. So an end that is the
    request's fault (REQUEST_ERRORS) is that 400; anything else streams (``make``) from the stream's start.

    The hold is bounded by --heartbeat-s (at the first heartbeat due, or the first event past that long): a job
    that waits in a long queue (or for a generator to start from zero) gets its status line and heartbeats
    instead of a silent connection that a proxy's read timeout, or the client's, would cut. Its prompt, refused
    later, ends that stream with the error chunk, as before."""
    events = service.tail(stream_id)
    seen: list[Event] = []
    deadline = time.monotonic() + service.settings.heartbeat_s
    try:
        async for ev in events:
            if ev is None:
                break  # a heartbeat is due: the status line goes, and the heartbeat after it
            seen.append(ev)
            if ev.type not in _BEFORE_THE_PROMPT or time.monotonic() >= deadline:
                break
    except BaseException:
        await events.aclose()
        raise
    last = seen[-1] if seen else None
    if last is not None and last.type == EventType.ERROR and last.json().get("code") in REQUEST_ERRORS:
        await events.aclose()
        err = _terminal_error(last)
        return error_json(400, err["message"], type_="invalid_request_error", code=err["code"],
                          headers={"x-should-retry": "false"})
    return make(_frames(chat, _again(seen, events), include_usage))


async def _again(seen: list[Event], rest: AsyncGenerator[Event | None, None]) -> AsyncGenerator[Event | None, None]:
    """The events read already, then the rest of the tail (closed with this generator)."""
    async with aclosing(rest):
        for ev in seen:
            yield ev
        async for later in rest:
            yield later


async def _frames(chat: _Chat, events: AsyncGenerator[Event | None, None],
                  include_usage: bool) -> AsyncIterator[bytes | None]:
    # The role comes first, as OpenAI sends it.
    yield data_frame(chat.chunk({"role": "assistant", "content": ""}))
    async with aclosing(events):
        async for ev in events:
            if ev is None:
                yield None  # heartbeat comment: the SDK skips it
            elif (delta := _delta(ev)) is not None:
                yield data_frame(chat.chunk(delta))
            elif ev.type == EventType.LOGPROBS:  # the tokens of the text just sent
                yield data_frame(chat.chunk({}, logprobs={"content": ev.json()["content"], "refusal": None}))
            elif ev.type == EventType.DONE:
                data = ev.json()
                yield data_frame(chat.chunk({}, data.get("finish_reason", "stop")))
                if include_usage:
                    yield data_frame({**chat.chunk({}), "choices": [], "usage": chat.usage(data.get("usage"))})
                yield DONE_FRAME
            elif ev.is_terminal:
                # Mid-stream errors are a bare {"error": ...} in OpenAI's streams: the SDK raises APIError.
                yield data_frame({"error": _terminal_error(ev)})
                yield DONE_FRAME


class _Answer:
    """The answer's events folded into one assistant message: its text, reasoning and tool calls."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.logprobs: list[dict[str, Any]] | None = None
        self.end: Event | None = None

    def feed(self, ev: Event) -> None:
        if ev.type == EventType.DELTA:
            self.texts.append(ev.json()["text"])
        elif ev.type == EventType.LOGPROBS:
            self.logprobs = (self.logprobs or []) + ev.json()["content"]
        elif ev.type == EventType.REASONING:
            self.reasoning.append(ev.json()["text"])
        elif ev.type == EventType.TOOL_CALL:
            call = _tool_call(ev.json())
            self.calls[call.pop("index")] = call
        elif ev.type == EventType.TOOL_ARGS:
            data = ev.json()
            if data["index"] in self.calls:
                self.calls[data["index"]]["function"]["arguments"] += data["text"]
        elif ev.is_terminal:
            self.end = ev

    def message(self) -> dict[str, Any]:
        text = "".join(self.texts)
        # OpenAI's content is null for an answer that only calls tools.
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not self.calls else None,
                                   "refusal": None, "annotations": []}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return message


async def _completion(service: StreamService, chat: _Chat, stream_id: uuid.UUID) -> Response:
    answer = _Answer()
    await service.fold(stream_id, answer.feed)  # the reader ends only after the terminal event
    ev = answer.end
    assert ev is not None
    if ev.type != EventType.DONE:
        # 409 (stopped by someone), 400 (the request could not run: a prompt past the model's context, a
        # parameter the engine refused), or 502 (the engine failed). The SDK would retry 409 and 502, each retry a
        # new generation paid in full: x-should-retry: false leaves that choice to the caller.
        err = _terminal_error(ev)
        status = 409 if ev.type == EventType.CANCELLED else 400 if err["code"] in REQUEST_ERRORS else 502
        return error_json(status, err["message"], type_="invalid_request_error" if status == 400 else err["type"],
                          code=err["code"], headers={"x-should-retry": "false"})
    data = ev.json()
    return JSONResponse({
        "id": chat.id, "object": "chat.completion", "created": chat.created, "model": chat.model,
        "service_tier": chat.service_tier,
        "system_fingerprint": None,
        "choices": [{"index": 0, "finish_reason": data.get("finish_reason", "stop"), "message": answer.message(),
                     "logprobs": None if answer.logprobs is None else {"content": answer.logprobs, "refusal": None}}],
        "usage": chat.usage(data.get("usage")),
    })


async def chat_completions(request: Request) -> ASGIApp:
    body = await read_json(request)
    state = state_of(request)
    service = state.service
    caller = caller_of(request)
    rsb_body, renames, dropped = _chat_body(body, service.limits_for(caller), drop=service.drops_unsupported(caller))
    stream = bool(body.get("stream"))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    with service.connection(caller_of(request)) as slot:
        stream_id, st = await create_stream(request, rsb_body, renames)
        chat = _Chat(stream_id, st)
        if stream:
            def streamed(frames: AsyncIterator[bytes | None]) -> Response:
                return SSEResponse(frames, shutdown=state.draining, send_timeout_s=state.settings.send_timeout_s,
                                   headers={STREAM_ID_HEADER: str(stream_id), **dropped_header(dropped)},
                                   shutdown_frame=_SHUTDOWN_FRAME, on_close=slot.release)

            return DeferredResponse(request, stream_id,
                                    lambda: _held(service, chat, stream_id, include_usage, streamed), slot.release,
                                    dropped_header(dropped))
        return DeferredResponse(request, stream_id, lambda: _completion(service, chat, stream_id), slot.release,
                                dropped_header(dropped))
