"""The front door: the route every reader holds open, ``GET /v1/streams/{id}/events``, served below
Starlette's middleware stack and router; every other request goes on to the Starlette app.

An SSE reader keeps its whole call chain alive for as long as it reads: under Starlette that is the error
middleware, the authentication middleware, the exception middleware, the router, the route and the
request wrapper, each a suspended frame, and each ``send`` goes through two wrappers. For thousands of
open readers that is memory per reader and CPU per event; for one resume it is part of the time to the
first event. The behaviour is the same as through the app: the same authentication (consumer.edge.middleware),
the same handler (consumer.views.native.stream_events), the same JSON errors (consumer.edge.errors). With CORS
configured, requests take the app's path, where the CORS middleware adds its headers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from broker.errors import Unauthorized
from consumer.edge.auth import ApiKeys
from consumer.edge.errors import error_for
from consumer.edge.middleware import authenticate, unauthorized
from consumer.edge.paths import EVENTS_PATH, EVENTS_ROUTE
from consumer.edge.tracing import ROUTE_KEY


class FrontDoor:
    """``app`` behind a door that serves the readers' route itself, with ``events`` (the native view's handler
    of that route, which the app's router also serves)."""

    def __init__(self, app: ASGIApp, events: Callable[[Request], Awaitable[Response]], keys: ApiKeys, *,
                 cors: bool) -> None:
        self.app = app
        self.events = events
        self.keys = keys
        self.cors = cors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = EVENTS_PATH.match(scope["path"]) if scope["type"] == "http" and scope["method"] == "GET" else None
        if m is None or self.cors:
            await self.app(scope, receive, send)
            return
        # This frame stays suspended under every open reader for as long as it reads: it keeps only the
        # response. The match, the Request and the handler's frame are gone by then (_respond returns).
        response = await self._respond(scope, receive, m.group("stream_id"))
        await response(scope, receive, send)

    async def _respond(self, scope: Scope, receive: Receive, stream_id: str) -> Response:
        """The route's response, or its error's (a 401 before anything else)."""
        scope["path_params"] = {"stream_id": stream_id}
        scope[ROUTE_KEY] = EVENTS_ROUTE
        request = Request(scope, receive)
        try:
            if self.keys.enabled:
                try:
                    scope["rsb.key_id"] = await authenticate(self.keys, scope)
                except Unauthorized as e:
                    return unauthorized(e)
            return await self.events(request)
        except Exception as exc:  # the app's one error boundary, as its exception handlers answer
            return await error_for(request, exc)
