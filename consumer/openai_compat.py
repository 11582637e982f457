"""OpenAI-compatible views onto rsb streams (chat.completions, Responses background mode).

The official ``openai`` SDK works against ``base_url=http://host:port/v1`` unchanged. Every route here
creates or reads the same Redis streams as ``/v1/streams``, through the same Store and reader; errors use
OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``). See ``consumer/openai_chat.py`` and
``consumer/openai_responses.py``.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp

from broker.errors import NotFound
from consumer.openai_chat import chat_completions
from consumer.openai_common import openai_route
from consumer.openai_responses import cancel_response, create_response, retrieve_response


def _model(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "rsb"}


async def list_models(request: Request) -> ASGIApp:
    """The model streams are recorded under when a request names none; clients probe this before a call."""
    return JSONResponse({"object": "list", "data": [_model(request.app.state.default_model)]})


async def retrieve_model(request: Request) -> ASGIApp:
    name = request.path_params["model"]
    if name != request.app.state.default_model:
        raise NotFound(f"the model {name!r} does not exist")
    return JSONResponse(_model(name))


ROUTES: list[BaseRoute] = [
    Route("/v1/chat/completions", openai_route(chat_completions), methods=["POST"]),
    Route("/v1/responses", openai_route(create_response), methods=["POST"]),
    Route("/v1/responses/{response_id}", openai_route(retrieve_response), methods=["GET"]),
    Route("/v1/responses/{response_id}/cancel", openai_route(cancel_response), methods=["POST"]),
    Route("/v1/models", openai_route(list_models), methods=["GET"]),
    Route("/v1/models/{model:path}", openai_route(retrieve_model), methods=["GET"]),
]
