"""What the OpenAI-compatible views share: OpenAI's error shape, turning a request into the rsb stream behind
it, and OpenAI's SSE frames.

These routes are views onto rsb streams, not a second pipeline: a create is the stream service's create
with a request validated by ``validate_create_body``, and every read is the service's reader (replay,
then the live hub), served by the consumer's one SSE response.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from broker.errors import (
    BudgetExceeded,
    Conflict,
    Expired,
    InvalidRequest,
    ModelNotFound,
    OverStorageQuota,
    Path,
    RetryLater,
    RsbError,
    spelled,
)
from broker.request.generation import GenerationRequest, check_body_depth, validate_create_body
from broker.request.history import History
from broker.sse import DONE_FRAME as DONE_FRAME  # the views' one [DONE], re-exported for chat and responses
from broker.sse import frame
from broker.streams.records import StreamStatus
from consumer.edge.errors import as_rsb_error, status_of
from consumer.edge.http import read_body
from consumer.state import caller_of, state_of
from consumer.streaming.service import Caller
from consumer.streaming.sse import STREAM_ID_HEADER as STREAM_ID_HEADER  # re-exported, as DONE_FRAME
from consumer.streaming.sse import Draining, Gone, race
from consumer.views.idempotency import HEADER as IDEMPOTENCY_HEADER
from consumer.views.idempotency import stream_id_for_key

#: OpenAI's message roles, as rsb's (``developer`` is OpenAI's newer name for ``system``).
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

Handler = Callable[[Request], Awaitable[ASGIApp]]


class OpenAIError(RsbError):
    """An error with OpenAI's fields, for what rsb's own exceptions cannot say (the parameter, the type), and
    its own HTTP status: it is made at this view's HTTP edge, in OpenAI's terms."""

    status_code: int

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status
        self.type = type_
        self.oai_code = code
        self.param = param
        self.headers = dict(headers or {})


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


def error_json(status: int, message: str, *, type_: str, code: str | None, param: str | None = None,
               headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=dict(headers) if headers else None)


def error_response(exc: RsbError) -> JSONResponse:
    """OpenAI's error shape for an rsb error. Statuses are chosen for how the SDK reacts to them: it
    retries 408/409/429/5xx, so a 409 that a retry cannot fix says ``x-should-retry: false``."""
    if isinstance(exc, OpenAIError):
        return error_json(exc.status_code, exc.message, type_=exc.type, code=exc.oai_code, param=exc.param,
                          headers=exc.headers)
    if isinstance(exc, ModelNotFound):
        return error_json(404, exc.message, type_="invalid_request_error", code=exc.code, param="model")
    if isinstance(exc, Expired):
        # The SDK has no class for 410; what a client can do is the same as for an unknown id.
        return error_json(404, exc.message, type_="invalid_request_error", code="expired")
    if isinstance(exc, Conflict):
        return error_json(409, exc.message, type_="invalid_request_error", code=exc.code,
                          headers={"x-should-retry": "false"})
    if isinstance(exc, BudgetExceeded):  # OpenAI's insufficient_quota: no retry of the SDK's helps before it renews
        return error_json(status_of(exc), exc.message, type_="insufficient_quota", code=exc.code,
                          headers={"Retry-After": str(exc.retry_after_s), "x-should-retry": "false"})
    if isinstance(exc, OverStorageQuota):  # a 429 the SDK's retries cannot fix: the caller must free data
        return error_json(status_of(exc), exc.message, type_="invalid_request_error", code=exc.code,
                          headers={"x-should-retry": "false"})
    status = status_of(exc)
    if isinstance(exc, RetryLater):
        type_ = "requests" if status == 429 else "server_error"
        return error_json(status, exc.message, type_=type_, code=exc.code,
                          headers={"Retry-After": str(exc.retry_after_s)})
    if status == 401:
        return error_json(401, exc.message, type_="invalid_request_error", code="invalid_api_key")
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    param = top_param(exc.param) if isinstance(exc, InvalidRequest) else None
    return error_json(status, exc.message, type_=type_, code=exc.code, param=param)


def openai_route(handler: Handler) -> Handler:
    """Answer rsb's errors in OpenAI's shape on these routes (the app-wide handlers use rsb's)."""

    async def wrapped(request: Request) -> ASGIApp:
        try:
            return await handler(request)
        except Exception as e:
            err = as_rsb_error(e)
            if err is None:
                raise  # a bug: the app's boundary logs it and answers 500
            return error_response(err)

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


async def read_json(request: Request) -> dict[str, Any]:
    raw = await read_body(request, state_of(request).settings.max_body_bytes)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid("the body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    check_body_depth(body)
    return body


@dataclass(frozen=True, slots=True)
class Only:
    """A parameter accepted only in the shape ``schema`` describes: what rsb cannot honour (tools, n > 1,
    logprobs, ...) is refused, not ignored. ``accepts`` is the same rule in code; both come from here, so
    the OpenAPI document (views/openai/schema.py) says exactly what the view accepts."""

    name: str
    schema: dict[str, Any]
    accepts: Callable[[object], bool]
    message: str
    #: A setting of how a model answers that rsb's models cannot honour (OpenAI's ``reasoning_effort``,
    #: ``verbosity``, ...), which agents send by default: with --drop-unsupported-params (or the caller's key's
    #: ``drop_unsupported_params``) it is dropped, not refused, and the response names it (DROPPED_PARAMS_HEADER).
    droppable: bool = False


NULL: dict[str, Any] = {"type": "null"}
#: The parameters a request had dropped (``Only.droppable``), comma-separated, when it had any.
DROPPED_PARAMS_HEADER = "x-rsb-dropped-params"


def null_only(name: str, *, droppable: bool = False) -> Only:
    return Only(name, NULL, lambda v: v is None, f"'{name}' is not supported", droppable)


def no_items(name: str) -> Only:
    return Only(name, {"anyOf": [{"type": "array", "maxItems": 0}, NULL]}, lambda v: v is None or v == [],
                f"'{name}' is not supported")


def boolean(name: str) -> Only:
    return Only(name, {"anyOf": [{"type": "boolean"}, NULL]}, lambda v: v is None or isinstance(v, bool),
                f"'{name}' must be true or false")


def check_only(body: dict[str, Any], rules: tuple[Only, ...], *, drop: bool = False) -> list[str]:
    """Refuse what rsb cannot honour; with ``drop``, the droppable ones are taken out of ``body`` instead. The
    names of the parameters dropped."""
    dropped = []
    for rule in rules:
        if not rule.accepts(body.get(rule.name)):
            if not (drop and rule.droppable):
                raise invalid(rule.message, rule.name)
            del body[rule.name]
            dropped.append(rule.name)
    return dropped


def dropped_header(dropped: Sequence[str]) -> dict[str, str]:
    """The response header that names the parameters a request had dropped (none: no header)."""
    return {DROPPED_PARAMS_HEADER: ",".join(dropped)} if dropped else {}


def check_known(body: Mapping[str, Any], known: frozenset[str]) -> None:
    """What rsb does not know is refused, not ignored (a typo, or a parameter rsb would silently not honour)."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])


def text_of(content: object, at: Path, part_types: frozenset[str], field: str = "content") -> str:
    """The text of the message at ``at`` (``("messages", 3)``; or a tool result's: ``field``): a string, or a list of
    text parts (joined); anything else is refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if not (isinstance(kind, str) and kind in part_types and isinstance(part.get("text"), str)):
                raise invalid(f"{spelled((*at, field, j))}: only text parts ({', '.join(sorted(part_types))}) are "
                              "supported", top_param(at))
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{spelled((*at, field))} must be a string or a list of text parts", top_param(at))


def unanswered_result(messages: Sequence[Mapping[str, Any]]) -> int | None:
    """The index of the first tool message that answers no call an earlier assistant message made (None: each
    answers one). OpenAI's rule, which its views hold a request to (messages in rsb's create shape); rsb's own create
    does not (a conversation's turn may answer a call of its history)."""
    calls: set[object] = set()
    for i, m in enumerate(messages):
        made = m.get("tool_calls")
        if m["role"] == "assistant" and isinstance(made, list):
            calls.update(c.get("id") for c in made if isinstance(c, dict))
        elif m["role"] == "tool" and m.get("tool_call_id") not in calls:
            return i
    return None


def stream_id_for(request: Request, caller: Caller) -> uuid.UUID:
    """A new stream per call, unless the client sends an Idempotency-Key: then retries of the call land on
    the same stream (one generation). The caller is part of the name, so tenants never share one."""
    try:
        return stream_id_for_key(request.headers.get(IDEMPOTENCY_HEADER), caller)
    except InvalidRequest as e:
        raise invalid(e.message, code="invalid_header") from None


def validated(request: Request, rsb_body: dict[str, Any], renames: Mapping[Path, Path], *,
              uncounted_messages: int = 0) -> GenerationRequest:
    """``rsb_body`` (a ``POST /v1/streams`` body) validated exactly as the native route does. ``renames`` maps rsb's
    fields to the client's (InvalidRequest.said: its messages and its ``param`` say the client's names);
    ``uncounted_messages`` leading messages (Responses' instructions) do not count against max_messages."""
    limits = state_of(request).service.limits_for(caller_of(request))
    limits = dataclasses.replace(limits, max_messages=limits.max_messages + uncounted_messages)
    try:
        return validate_create_body(rsb_body, limits)[1]
    except InvalidRequest as e:
        message, param = e.said(renames)
        raise invalid(message, top_param(param)) from None


def top_param(path: Path | None) -> str | None:
    """OpenAI's ``param``: the request's field an error is about (the first of its path)."""
    return None if not path else str(path[0])


async def create_stream(request: Request, rsb_body: dict[str, Any], renames: Mapping[Path, Path], *,
                        uncounted_messages: int = 0, history: History | None = None,
                        hook_name: Callable[[uuid.UUID], str] | None = None) -> tuple[uuid.UUID, StreamStatus]:
    """Validate ``rsb_body`` (``validated``), create the stream (recording ``history``), and return it with its
    status. ``hook_name``: the id its webhook event names (StreamService.webhook)."""
    service = state_of(request).service
    caller = caller_of(request)
    gen_request = validated(request, rsb_body, renames, uncounted_messages=uncounted_messages)
    if history is not None:
        gen_request = dataclasses.replace(gen_request, history=history)
    stream_id = stream_id_for(request, caller)
    try:
        await service.create(caller, gen_request, stream_id, hook_name=hook_name)
    except Conflict:
        raise Conflict("this Idempotency-Key was used with a different request") from None
    except Expired:
        raise OpenAIError(409, "this Idempotency-Key was used for a generation that has expired; use a new key",
                          code="expired", headers={"x-should-retry": "false"}) from None
    return stream_id, await service.status(caller, stream_id)


def data_frame(obj: object) -> bytes:
    return frame(orjson.dumps(obj))


def event_frame(obj: dict[str, Any]) -> bytes:
    """A Responses API event: its ``type`` is also the SSE event's name."""
    return frame(orjson.dumps(obj), event=str(obj["type"]).encode())


class DeferredResponse(Response):
    """A JSON answer that needs the end of a generation. The wait is abandoned when the client goes away
    (nobody to answer) or the pod drains (503: retry elsewhere), like an SSE response's. ``on_close`` runs
    when it is over, however it ended (connection accounting)."""

    def __init__(self, request: Request, stream_id: uuid.UUID, compute: Callable[[], Awaitable[Response]],
                 on_close: Callable[[], None], headers: Mapping[str, str] | None = None) -> None:
        self.status_code = 200
        self.headers_given = dict(headers or {})
        self.init_headers({STREAM_ID_HEADER: str(stream_id), **self.headers_given})
        self.compute = compute
        self.draining = state_of(request).draining
        self.stream_id = str(stream_id)
        self.on_close = on_close

    def shutting_down(self) -> Response:
        """The answer when the pod drains before the generation ends (a view in another protocol overrides it)."""
        return error_json(503, "this server is shutting down; retry", type_="server_error", code="shutting_down",
                          headers={"Retry-After": "1"})

    def failed(self, err: RsbError) -> Response:
        """The answer to an rsb error raised while waiting (a view in another protocol overrides it)."""
        return error_response(err)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            try:
                response = await race(self.compute(), receive, self.draining)
            except Gone:
                return
            except Draining:
                response = self.shutting_down()
            except Exception as e:
                err = as_rsb_error(e)
                if err is None:
                    raise
                response = self.failed(err)
            response.headers[STREAM_ID_HEADER] = self.stream_id
            for name, value in self.headers_given.items():
                response.headers[name] = value
            await response(scope, receive, send)
        finally:
            self.on_close()


def usage_tokens(usage: Mapping[str, Any] | None) -> tuple[int, int]:
    """(prompt, completion) tokens of an rsb usage object."""
    if not usage:
        return 0, 0
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def cached_tokens(usage: Mapping[str, Any] | None) -> int:
    """Prompt tokens of an rsb usage object served from the generator's prompt cache."""
    return int((usage or {}).get("cached_tokens") or 0)
