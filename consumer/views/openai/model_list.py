"""``GET /v1/models``: the models the generators serve (what their ``started`` events name), or
``--default-model`` when set; clients probe this before a call. Empty while no generator has announced one."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from broker.errors import NotFound
from consumer.state import state_of


def _model(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "rsb"}


async def list_models(request: Request) -> ASGIApp:
    names = await state_of(request).service.served_models()
    return JSONResponse({"object": "list", "data": [_model(name) for name in names]})


async def retrieve_model(request: Request) -> ASGIApp:
    name = request.path_params["model"]
    if name not in await state_of(request).service.served_models():
        raise NotFound(f"the model {name!r} does not exist")
    return JSONResponse(_model(name))
