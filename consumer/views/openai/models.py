"""``GET /v1/models``: the model streams are recorded under when a request names none; clients probe this
before a call."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from broker.errors import NotFound
from consumer.state import state_of


def _model(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "rsb"}


async def list_models(request: Request) -> ASGIApp:
    return JSONResponse({"object": "list", "data": [_model(state_of(request).service.default_model)]})


async def retrieve_model(request: Request) -> ASGIApp:
    name = request.path_params["model"]
    if name != state_of(request).service.default_model:
        raise NotFound(f"the model {name!r} does not exist")
    return JSONResponse(_model(name))
