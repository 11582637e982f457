"""``GET /v1/models``: the models the generators serve (what their ``started`` events name) and the aliases they
answer to (``root``: the model an alias runs on), with ``--default-model`` listed even while no generator announces
it (its creates wait in its queue); clients probe this before a call. Empty while nothing is served.

Beside OpenAI's ``object`` and ``data``, rsb's ``default_model`` (what a create that names none runs on: the
``--default-model``, else the only model served; null when a create must name one) and ``service_tiers`` (the
tiers the caller's API key may choose between, its ``service_tiers`` in the keys file; empty: it has no choice):
what the bundled page's model and tier pickers show."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from broker.errors import ModelNotFound
from broker.request.tiers import TIERS
from broker.streams.served_models import ServedModel
from consumer.state import caller_of, state_of


def _model(m: ServedModel) -> dict[str, object]:
    return {"id": m.id, "object": "model", "created": 0, "owned_by": "rsb", "root": m.root}


async def list_models(request: Request) -> ASGIApp:
    state = state_of(request)
    served = await state.service.served_models()
    roots = list(dict.fromkeys(m.root for m in served))
    default = state.settings.default_model or (roots[0] if len(roots) == 1 else None)
    key = state.api_keys.get(caller_of(request).key_id)
    tiers = [t for t in TIERS if key is not None and t in key.service_tiers]
    return JSONResponse({"object": "list", "data": [_model(m) for m in served], "default_model": default,
                         "service_tiers": tiers if len(tiers) > 1 else []})


async def retrieve_model(request: Request) -> ASGIApp:
    name = request.path_params["model"]
    served = await state_of(request).service.served_models()
    for m in served:
        if m.id == name:
            return JSONResponse(_model(m))
    raise ModelNotFound(name, [m.id for m in served])
