"""``POST /v1/chat/completions``: a chat completion is one rsb stream, read as ``chat.completion.chunk``
objects (``stream: true``) or folded into one ``chat.completion`` once it ends.

The generation runs on whether or not this connection stays: the ``x-rsb-stream-id`` response header names
the stream, which ``/v1/streams/{id}/events`` resumes.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from broker.events import Event, EventType
from broker.store import StreamStatus
from consumer.service import StreamService
from consumer.sse import SSEResponse
from consumer.state import caller_of, state_of
from consumer.views.openai.common import (
    DONE_FRAME,
    ROLES,
    STREAM_ID_HEADER,
    DeferredResponse,
    create_stream,
    data_frame,
    error_json,
    invalid,
    read_json,
    text_of,
    usage_tokens,
)

_TEXT_PARTS = frozenset({"text"})
# Shutdown mid-stream: an error the SDK raises, instead of an answer silently cut short.
_SHUTDOWN_FRAME = data_frame({"error": {"message": "the server is shutting down; the generation goes on: "
                                        "resume it at /v1/streams/{x-rsb-stream-id}/events",
                                        "type": "server_error", "param": None, "code": "shutting_down"}})


def _chat_body(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The rsb create body for a chat request, and the renames for its validation messages. Parameters
    that would change what is generated and that rsb cannot honour are refused, not ignored."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty list", "messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}] must be an object", "messages")
        role = ROLES.get(str(m.get("role")))
        if role is None:
            raise invalid(f"messages[{i}].role must be one of system, developer, user, assistant "
                          "(tools are not supported)", "messages")
        messages.append({"role": role, "content": text_of(m.get("content"), f"messages[{i}]", _TEXT_PARTS)})
    n = body.get("n")
    if n is not None and n != 1:
        raise invalid("only 'n': 1 is supported", "n")
    for name in ("tools", "functions"):
        if body.get(name):
            raise invalid(f"'{name}' is not supported", name)
    for name in ("audio", "prediction", "web_search_options"):
        if body.get(name) is not None:
            raise invalid(f"'{name}' is not supported", name)
    if body.get("logprobs") or body.get("top_logprobs") is not None:
        raise invalid("logprobs are not supported", "logprobs")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise invalid("only 'response_format': {'type': 'text'} is supported", "response_format")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise invalid("only the text modality is supported", "modalities")
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    rsb: dict[str, Any] = {"messages": messages, "max_tokens": body.get(limit_name)}
    for name in ("model", "temperature", "top_p", "seed", "stop"):
        rsb[name] = body.get(name)
    return rsb, {"max_tokens": limit_name}


class _Chat:
    """The fixed fields of every object of one completion."""

    def __init__(self, stream_id: uuid.UUID, st: StreamStatus, model: str) -> None:
        self.id = f"chatcmpl-{stream_id.hex}"
        self.created = int(st.created_at)
        # The model as requested, like ResponseView: StreamStatus.model becomes the engine's name at the end.
        self.model = model

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    def usage(self, usage: dict[str, Any] | None) -> dict[str, int]:
        prompt, completion = usage_tokens(usage)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _terminal_error(ev: Event) -> dict[str, Any]:
    """OpenAI's error object for a stream that ended without an answer: cancelled or failed."""
    data = ev.json()
    if ev.type == EventType.CANCELLED:
        return {"message": f"the generation was cancelled ({data.get('reason', 'client')})",
                "type": "invalid_request_error", "param": None, "code": "cancelled"}
    return {"message": f"the generation failed: {data.get('message', '')}", "type": "server_error",
            "param": None, "code": str(data.get("code", "engine"))}


async def _frames(service: StreamService, chat: _Chat, stream_id: uuid.UUID,
                  include_usage: bool) -> AsyncIterator[bytes | None]:
    # The role comes first, as OpenAI sends it, before the queue wait: the client sees the call was taken.
    yield data_frame(chat.chunk({"role": "assistant", "content": ""}))
    async with aclosing(service.tail(stream_id)) as events:
        async for ev in events:
            if ev is None:
                yield None  # heartbeat comment: the SDK skips it
            elif ev.type == EventType.DELTA:
                yield data_frame(chat.chunk({"content": ev.json()["text"]}))
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


async def _completion(service: StreamService, chat: _Chat, stream_id: uuid.UUID) -> Response:
    texts: list[str] = []
    end: list[Event] = []

    def feed(ev: Event) -> None:
        if ev.type == EventType.DELTA:
            texts.append(ev.json()["text"])
        elif ev.is_terminal:
            end.append(ev)

    await service.fold(stream_id, feed)  # the reader ends only after the terminal event
    ev = end[0]
    if ev.type != EventType.DONE:
        # 409 (stopped by someone) or 502 (the engine failed). The SDK would retry both, each retry a new
        # generation paid in full: x-should-retry: false leaves that choice to the caller.
        err = _terminal_error(ev)
        return error_json(409 if ev.type == EventType.CANCELLED else 502, err["message"], type_=err["type"],
                          code=err["code"], headers={"x-should-retry": "false"})
    data = ev.json()
    return JSONResponse({
        "id": chat.id, "object": "chat.completion", "created": chat.created, "model": chat.model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "logprobs": None, "finish_reason": data.get("finish_reason", "stop"),
                     "message": {"role": "assistant", "content": "".join(texts), "refusal": None,
                                 "annotations": []}}],
        "usage": chat.usage(data.get("usage")),
    })


async def chat_completions(request: Request) -> ASGIApp:
    body = await read_json(request)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    rsb_body, renames = _chat_body(body)
    state = state_of(request)
    service = state.service
    with service.connection(caller_of(request)) as slot:
        stream_id, st = await create_stream(request, rsb_body, renames)
        chat = _Chat(stream_id, st, rsb_body["model"] or service.default_model)
        if stream:
            return SSEResponse(_frames(service, chat, stream_id, include_usage), shutdown=state.draining,
                               send_timeout_s=state.settings.send_timeout_s,
                               headers={STREAM_ID_HEADER: str(stream_id)}, shutdown_frame=_SHUTDOWN_FRAME,
                               on_close=slot.release)
        return DeferredResponse(request, stream_id, lambda: _completion(service, chat, stream_id), slot.release)
