"""``GET /v1/models``: the models the generators serve (what their ``started`` events name) and the aliases they
answer to (``root``: the model an alias runs on), with ``--default-model`` listed even while no generator announces
it (its creates wait in its queue); clients probe this before a call. Empty while nothing is served."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from broker.errors import ModelNotFound
from broker.streams.served_models import ServedModel
from consumer.state import state_of


def _model(m: ServedModel) -> dict[str, object]:
    return {"id": m.id, "object": "model", "created": 0, "owned_by": "rsb", "root": m.root}


async def list_models(request: Request) -> ASGIApp:
    served = await state_of(request).service.served_models()
    return JSONResponse({"object": "list", "data": [_model(m) for m in served]})


async def retrieve_model(request: Request) -> ASGIApp:
    name = request.path_params["model"]
    served = await state_of(request).service.served_models()
    for m in served:
        if m.id == name:
            return JSONResponse(_model(m))
    raise ModelNotFound(name, [m.id for m in served])
