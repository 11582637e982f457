"""The chat page served at ``/`` and its ES module client."""

from __future__ import annotations

from starlette.routing import BaseRoute

ROUTES: list[BaseRoute] = []
