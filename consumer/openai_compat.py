"""OpenAI-compatible views onto rsb streams (chat.completions, Responses background mode)."""

from __future__ import annotations

from starlette.routing import BaseRoute

ROUTES: list[BaseRoute] = []
