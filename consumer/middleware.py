"""ASGI middleware: authentication of /v1 routes, before any handler runs."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from consumer.auth import ApiKeys, Unauthorized
from consumer.errors import error_response


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            scope["rsb.key_id"] = self.keys.authenticate(authorization)
        except Unauthorized as e:
            response = error_response(401, e.code, e.message, {"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
