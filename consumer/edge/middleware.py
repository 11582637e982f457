"""ASGI middleware: what refused requests cost their sender (``RefusalLimit``), and authentication of the API
routes (``/v1/...`` and the AI SDK view's ``/api/...``), before any handler runs."""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.ascii import parse_uuid
from broker.errors import TooManyRefusals, Unauthorized
from consumer.edge.auth import ApiKeys
from consumer.edge.errors import anthropic_error_object, error_for, refusal
from consumer.edge.limits import RefusalBudget, address_group
from consumer.edge.paths import EVENTS_PATH, STREAM_PATH

# The paths that need an API key when keys are configured (the page, its assets and the probes do not).
_API_PREFIXES = ("/v1/", "/api/")
# With keys, the metrics too: they count every tenant's streams and aborted work (docs/security.md).
METRICS_PATH = "/metrics"
# Anthropic's Messages view (consumer/views/anthropic): its 401 is in Anthropic's error shape.
ANTHROPIC_PREFIX = "/v1/messages"
# The routes a read token opens (EventSource and a status poll): GET only, one stream.
_READABLE = (EVENTS_PATH, STREAM_PATH)


# Requests without a body: refused by an address's empty budget like any other, but not watched (no wrapper on
# each event an SSE reader is sent; their refusals cost the pod a lookup, not a parse).
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS"})
# Probes and scrapes are answered whatever their address sent: a pod is not unready because a client misbehaves.
_ALWAYS = frozenset({"/healthz", "/readyz", METRICS_PATH})


class RefusalLimit:
    """Outside every route and check: a request from an address whose refusal budget is spent is answered 429
    ``too_many_refusals`` before anything reads it; a request with a body that ends in a 4xx (429 aside: those
    are limits of their own) charges its address (consumer.edge.limits.RefusalBudget)."""

    def __init__(self, app: ASGIApp, budget: RefusalBudget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.budget.enabled or scope["path"] in _ALWAYS:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        who = address_group(client[0]) if client else ""
        wait_s = self.budget.retry_after_s(who)
        if wait_s is not None:
            err = TooManyRefusals("too many refused requests from this address; retry later", wait_s)
            if scope["path"].startswith(ANTHROPIC_PREFIX):  # in the shape its clients read
                answer = anthropic_error(429, "rate_limit_error", err.message, {"Retry-After": str(wait_s)})
            else:
                answer = refusal(err)
            await answer(scope, receive, send)
            return
        if scope["method"] in _BODILESS:
            await self.app(scope, receive, send)
            return
        received = status = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
            return message

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, counted, watched)
        finally:
            if 400 <= status < 500 and status != 429:
                self.budget.charge(who, received)


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys, metrics_token: str | None = None) -> None:
        self.app = app
        self.keys = keys
        self.metrics_token = metrics_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or not (
                scope["path"].startswith(_API_PREFIXES) or scope["path"] == METRICS_PATH):
            await self.app(scope, receive, send)
            return
        try:
            if scope["path"] == METRICS_PATH:
                authenticate_metrics(self.keys, self.metrics_token, scope)
            else:
                scope["rsb.key_id"] = await authenticate(self.keys, scope)
        except Unauthorized as e:
            await unauthorized(e, scope["path"])(scope, receive, send)
            return
        except Exception as exc:  # the read-token key's first read found Redis away: 503, as any route would
            await (await error_for(Request(scope, receive), exc))(scope, receive, send)
            return
        await self.app(scope, receive, send)


def anthropic_error(status: int, type_: str, message: str, headers: dict[str, str]) -> JSONResponse:
    """An answer before any route runs, on Anthropic's routes: in Anthropic's error shape (its view,
    consumer.views.anthropic.errors, answers every other)."""
    return JSONResponse(anthropic_error_object(type_, message), status_code=status, headers=headers)


def unauthorized(e: Unauthorized, path: str = "") -> JSONResponse:
    # Before any route runs: the body carries both rsb's fields (code, message) and OpenAI's (type, param), which
    # every view's clients read, except on Anthropic's routes, whose clients read Anthropic's error shape.
    headers = {"WWW-Authenticate": "Bearer"}
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error(401, "authentication_error", e.message, headers)
    body = {"error": {"code": e.code, "message": e.message, "type": "invalid_request_error", "param": None}}
    return JSONResponse(body, status_code=401, headers=headers)


async def authenticate(keys: ApiKeys, scope: Scope) -> str:
    """The caller's key id, from the Authorization header (else an ``x-api-key`` header, as Anthropic's clients
    send the same key) or a read token; raises Unauthorized."""
    authorization = api_key = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            authorization = value.decode("latin-1")
            break
        if name == b"x-api-key" and api_key is None:
            api_key = value.decode("latin-1")
    if authorization is None and api_key is not None:
        authorization = f"Bearer {api_key}"
    if authorization is None and scope["method"] == "GET":
        m = next((m for p in _READABLE if (m := p.match(scope["path"])) is not None), None)
        token = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
        if m is not None and token:
            stream_id = parse_uuid(m.group("stream_id"))
            if stream_id is None:
                raise Unauthorized("invalid read token")
            return await keys.check_read_token(token[0], stream_id)
    return keys.authenticate(authorization)


def authenticate_metrics(keys: ApiKeys, metrics_token: str | None, scope: Scope) -> None:
    """/metrics with keys: any valid API key, or ``Bearer <--metrics-token>``; raises Unauthorized otherwise."""
    authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
    if metrics_token and authorization and authorization.startswith("Bearer ") and hmac.compare_digest(
            authorization[len("Bearer "):].strip().encode(), metrics_token.encode()):
        return
    keys.authenticate(authorization)
