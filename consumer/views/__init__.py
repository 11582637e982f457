"""The protocol views: each serves the same streams (through consumer.streaming.service) in one protocol's shape.
A new protocol is one module (or subpackage) here plus its line in ``ROUTES``."""

from __future__ import annotations

from starlette.routing import BaseRoute

from consumer.views import aisdk, anthropic, durable, native, openai, ops, web

ROUTES: list[BaseRoute] = [*native.ROUTES, *ops.ROUTES, *openai.ROUTES, *anthropic.ROUTES, *aisdk.ROUTES,
                           *durable.ROUTES, *web.ROUTES]
