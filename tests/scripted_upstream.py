"""A scripted OpenAI-compatible server: a real HTTP server (uvicorn, in a thread, on a free port) that streams
chat completions exactly as vLLM does, with what each test scripts.

It plays an engine whose output must be exact: reasoning (``delta.reasoning_content``, or ``delta.reasoning``
as vLLM 0.10+ names it), text, and tool calls in pieces (``delta.tool_calls[{index, id, type, function: {name,
arguments}}]``: id and name first, then the arguments in pieces), then the finish reason (``tool_calls`` after
calls), the ``include_usage`` record and ``[DONE]``. Every request body it receives is recorded (``requests``), with
its headers, so a test can check what it was sent (the tools, the history, a continuation, a traceparent).

    with ScriptedUpstream() as up:
        up.script(Reply([reasoning("Let me think."), call(0, "call_1", "get_weather"),
                         args(0, '{"city": '), args(0, '"Paris"}')], finish_reason="tool_calls", delay_s=0.05))
        ... rsb generator --upstream up.url ...
        assert up.requests[0].body["tools"] == [...]

Replies are served in the order they were scripted, one per request; with none left, ``respond`` answers
(a function of the request body: by default a short text). A request's ``max_tokens`` is honoured as vLLM does (the reply's first deltas, then
``finish_reason: length``). A reply can also fail (an HTTP status), cut the stream after some chunks (no finish, as a
crashing server does), or hold the stream open until the client leaves (``hold``, recorded in
``disconnects``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from broker.redis.server import free_port

MODEL = "scripted-model"


# -- the deltas a reply streams, one record each ---------------------------------------------------------


def text(s: str) -> dict[str, Any]:
    return {"content": s}


def reasoning(s: str, field_name: str = "reasoning_content") -> dict[str, Any]:
    """A piece of reasoning; vLLM 0.10+ sends it as ``reasoning``, earlier versions (and DeepSeek) as
    ``reasoning_content``."""
    return {field_name: s}


def call(index: int, call_id: str, name: str) -> dict[str, Any]:
    """A tool call begins: vLLM sends its index, id, type and name first, without arguments."""
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function", "function": {"name": name}}]}


def args(index: int, piece: str) -> dict[str, Any]:
    """A piece of call ``index``'s arguments (JSON text)."""
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}


def tool_call_pieces(index: int, call_id: str, name: str, arguments: str, piece_chars: int = 4) -> list[dict[str, Any]]:
    """A whole call as vLLM streams it: the start, then the arguments in pieces of ``piece_chars``."""
    return [call(index, call_id, name), *(args(index, arguments[i:i + piece_chars])
                                          for i in range(0, len(arguments), piece_chars))]


@dataclass
class Reply:
    """One scripted answer. ``deltas`` are streamed one per record, ``delay_s`` apart (``first_delay_s`` before
    the first); the last carries ``finish_reason``. ``usage`` defaults to one completion token per delta."""

    deltas: list[dict[str, Any]]
    finish_reason: str = "stop"
    delay_s: float = 0.0
    first_delay_s: float = 0.0
    usage: dict[str, int] | None = None
    status: int = 200  # another status answers {"error": {"message": error}} at once
    error: str = "scripted failure"
    cut_after: int | None = None  # close the stream after this many deltas: no finish, no [DONE]
    hold: bool = False  # after the deltas, keep the stream open (no finish) until the client leaves
    include_usage: bool = True  # the include_usage record (when the request asks for it)
    stop_reason: str | None = None  # vLLM's: the stop string that ended the answer (the last record's)

    def completion_tokens(self) -> int:
        return len(self.deltas)


def default_reply(body: dict[str, Any]) -> Reply:
    return Reply([text("Hello"), text(" there"), text("!")])


def paced(tokens_per_s: float) -> Callable[[dict[str, Any]], Reply]:
    """A ``respond`` that answers every request with as many words as it asks for (``max_tokens``: `` w0 w1 ...``,
    then ``length``), at a steady pace: an engine whose speed a test can count on, at no CPU cost (the fault tests'
    generations last as long as the faults they ride through)."""
    def reply(body: dict[str, Any]) -> Reply:
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        return Reply([text(f" w{i}") for i in range(n)], delay_s=1 / tokens_per_s, finish_reason="length")

    return reply


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    at: float = field(default_factory=time.monotonic)
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names (a traceparent, an authorization)


class ScriptedUpstream:
    """``owned_by``: what its model list says (``vllm``: it is vLLM, as rsb detects one); ``priority_scheduling``:
    False answers a request with a ``priority`` other than 0 as a vLLM without ``--scheduling-policy priority``
    does (400). Ollama's native API is served too (``/api/tags``, ``/api/chat``, ``/api/generate``: NDJSON)."""

    def __init__(self, *, reasoning_field: str = "reasoning_content", owned_by: str = "tests",
                 priority_scheduling: bool = True, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.reasoning_field = reasoning_field
        self.owned_by = owned_by
        self.priority_scheduling = priority_scheduling
        self.requests: list[Received] = []
        self.disconnects = 0
        self.respond: Callable[[dict[str, Any]], Reply] = default_reply
        self._replies: deque[Reply] = deque()
        self._lock = threading.Lock()
        app = Starlette(routes=[
            Route("/v1/models", self._models),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/api/tags", self._tags),
            Route("/api/chat", self._ollama, methods=["POST"]),
            Route("/api/generate", self._ollama, methods=["POST"]),
        ])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="scripted-upstream", daemon=True)

    # -- use --------------------------------------------------------------------------------------------

    def start(self) -> ScriptedUpstream:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "the scripted upstream did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def __enter__(self) -> ScriptedUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def script(self, *replies: Reply) -> None:
        """Queue replies, served one per request in this order."""
        with self._lock:
            self._replies.extend(replies)

    def bodies(self, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        return [r.body for r in self.requests if r.path == path]

    def wait_requests(self, n: int, timeout_s: float = 30.0) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        while len(self.requests) < n:
            assert time.monotonic() < deadline, f"{len(self.requests)} of {n} requests arrived"
            time.sleep(0.01)
        return self.requests

    # -- the server ---------------------------------------------------------------------------------------

    def _next(self, body: dict[str, Any]) -> Reply:
        with self._lock:
            if self._replies:
                return self._replies.popleft()
        return self.respond(body)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": self.owned_by}]})

    async def _tags(self, request: Request) -> Response:
        return JSONResponse({"models": [{"name": MODEL, "model": MODEL}]})

    async def _ollama(self, request: Request) -> Response:
        """Ollama's native API, streamed as NDJSON: the reply's text, then the ``done`` line with its counts."""
        body = orjson.loads(await request.body())
        self.requests.append(Received(request.url.path, body))
        reply = self._next(body)
        chat = request.url.path == "/api/chat"

        async def lines() -> AsyncIterator[bytes]:
            for i, delta in enumerate(reply.deltas):
                if i and reply.delay_s:
                    await asyncio.sleep(reply.delay_s)
                piece = delta.get("content", "")
                line = {"message": {"role": "assistant", "content": piece}} if chat else {"response": piece}
                yield orjson.dumps({"model": MODEL, **line, "done": False}) + b"\n"
            end = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
            yield orjson.dumps({"model": MODEL, **end, "done": True, "done_reason": reply.finish_reason,
                                "prompt_eval_count": 10, "eval_count": len(reply.deltas)}) + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def _chat(self, request: Request) -> Response:
        return await self._answer(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._answer(request, chat=False)

    async def _answer(self, request: Request, *, chat: bool) -> Response:
        body = orjson.loads(await request.body())
        self.requests.append(Received(request.url.path, body, headers=dict(request.headers)))
        if body.get("priority") and not self.priority_scheduling:  # vLLM's own refusal, word for word
            return JSONResponse({"object": "error", "message": f"Got priority {body['priority']} but Priority "
                                 "scheduling is not enabled.", "type": "BadRequestError", "param": None, "code": 400},
                                status_code=400)
        reply = _within(self._next(body), body.get("max_completion_tokens") or body.get("max_tokens"))
        if reply.status != 200:
            return JSONResponse({"error": {"message": reply.error, "type": "BadRequestError", "code": reply.status}},
                                status_code=reply.status)
        if not body.get("stream"):
            return JSONResponse(self._whole(reply, chat))
        usage = bool((body.get("stream_options") or {}).get("include_usage")) and reply.include_usage
        return StreamingResponse(self._stream(request, reply, chat, usage), media_type="text/event-stream")

    def _record(self, choice: dict[str, Any], chat: bool) -> bytes:
        obj = {"id": "chatcmpl-scripted" if chat else "cmpl-scripted",
               "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
               "model": MODEL, "choices": [choice]}
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        if "reasoning_content" in delta and self.reasoning_field != "reasoning_content":
            delta = {self.reasoning_field: delta["reasoning_content"]}
        return delta

    async def _stream(self, request: Request, reply: Reply, chat: bool, usage: bool) -> AsyncIterator[bytes]:
        if chat:  # vLLM opens the turn with the role and an empty content
            yield self._record({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}, chat)
        if reply.first_delay_s:
            await asyncio.sleep(reply.first_delay_s)
        n = len(reply.deltas)
        for i, delta in enumerate(reply.deltas):
            if reply.cut_after is not None and i >= reply.cut_after:
                return
            if i and reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if chat:
                choice = {"index": 0, "delta": self._delta(delta), "logprobs": None, "finish_reason": None}
            else:
                choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": None}
            yield self._record(choice, chat)
        if reply.cut_after is not None and reply.cut_after >= n:
            return
        if reply.hold:
            try:
                # Polled: depending on the ASGI spec version Starlette either cancels this generator when the
                # client leaves, or leaves the noticing to us.
                while not await request.is_disconnected():  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            finally:
                self.disconnects += 1
            return
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        # vLLM's last record: an empty content with the finish reason.
        last = {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": reply.finish_reason,
                "stop_reason": reply.stop_reason} if chat else {"index": 0, "text": "", "logprobs": None,
                                                                "finish_reason": reply.finish_reason,
                                                                "stop_reason": reply.stop_reason}
        yield self._record(last, chat)
        if usage:
            u = reply.usage or {"prompt_tokens": 10, "completion_tokens": reply.completion_tokens()}
            u = {**u, "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}
            yield b"data: " + orjson.dumps({"id": "chatcmpl-scripted", "object": "chat.completion.chunk",
                                            "created": int(time.time()), "model": MODEL, "choices": [],
                                            "usage": u}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    def _whole(self, reply: Reply, chat: bool) -> dict[str, Any]:
        """The reply as one (non-streamed) completion."""
        content = "".join(d.get("content", "") for d in reply.deltas)
        usage = reply.usage or {"prompt_tokens": 10, "completion_tokens": reply.completion_tokens()}
        if not chat:
            return {"id": "cmpl-scripted", "object": "text_completion", "model": MODEL, "usage": usage,
                    "choices": [{"index": 0, "text": content, "finish_reason": reply.finish_reason}]}
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        calls = list(_calls(reply.deltas))
        if calls:
            message["tool_calls"] = calls
        thought = "".join(d.get("reasoning_content", "") for d in reply.deltas)
        if thought:
            message[self.reasoning_field] = thought
        return {"id": "chatcmpl-scripted", "object": "chat.completion", "model": MODEL, "usage": usage,
                "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason}]}


def _within(reply: Reply, max_tokens: object) -> Reply:
    """The reply as vLLM answers a request's ``max_tokens``: its first deltas, then ``finish_reason: length``
    (the usage counts what was sent; a scripted ``usage`` keeps its prompt count)."""
    if not isinstance(max_tokens, int) or len(reply.deltas) <= max_tokens:
        return reply
    usage = None if reply.usage is None else {**reply.usage, "completion_tokens": max_tokens}
    return dataclasses.replace(reply, deltas=reply.deltas[:max_tokens], finish_reason="length", usage=usage)


def _calls(deltas: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for piece in d.get("tool_calls", ()):
            c = calls.setdefault(piece["index"], {"id": None, "type": "function",
                                                  "function": {"name": None, "arguments": ""}})
            c["id"] = piece.get("id") or c["id"]
            fn = piece.get("function", {})
            c["function"]["name"] = fn.get("name") or c["function"]["name"]
            c["function"]["arguments"] += fn.get("arguments", "")
    yield from (calls[i] for i in sorted(calls))
