"""Anthropic's Messages API as a view onto rsb streams: ``POST /v1/messages``, ``GET /v1/messages/{id}/events`` (a
message read again, or resumed after an event id: rsb's extension) and ``POST /v1/messages/count_tokens``.

The ``anthropic`` SDKs, LangChain's ``ChatAnthropic`` and the AI SDK's ``@ai-sdk/anthropic`` work against
``base_url=http://host:port`` unchanged. A message is an rsb stream: created and read through the same stream
service as ``/v1/streams`` (keys, tenants, limits, budgets, tiers and the usage ledger included), never a second
pipeline. Errors are Anthropic's (``{"type": "error", "error": {"type", "message"}}``, its status codes)."""

from __future__ import annotations

from starlette.routing import BaseRoute, Route

from consumer.views.anthropic.errors import anthropic_route
from consumer.views.anthropic.routes import count_tokens, create_message, message_events

#: The request headers Anthropic's clients send besides Content-Type (what a CORS preflight must allow).
REQUEST_HEADERS = ("X-Api-Key", "Anthropic-Version", "Anthropic-Beta")

ROUTES: list[BaseRoute] = [
    Route("/v1/messages", anthropic_route(create_message), methods=["POST"]),
    Route("/v1/messages/{message_id}/events", anthropic_route(message_events), methods=["GET"]),
    Route("/v1/messages/count_tokens", anthropic_route(count_tokens), methods=["POST"]),
]
