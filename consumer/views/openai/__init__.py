"""OpenAI-compatible views onto rsb streams (chat.completions, Responses background mode, Conversations, models).

The official ``openai`` SDK works against ``base_url=http://host:port/v1`` unchanged. Every route here
creates or reads the same Redis streams as ``/v1/streams``, through the same stream service; errors use
OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

from starlette.convertors import Convertor, register_url_convertor
from starlette.routing import BaseRoute, Route

from consumer.views.openai import conversations as conv
from consumer.views.openai.chat import chat_completions
from consumer.views.openai.common import openai_route
from consumer.views.openai.model_list import list_models, retrieve_model
from consumer.views.openai.responses import cancel_response, create_response, retrieve_response


class _AnyPath(Convertor[str]):
    """Starlette's ``path`` stops at a newline (its regex is ``.*``): a model name may contain anything, and
    an unknown one must get OpenAI's 404, not the router's."""

    regex = "[\\s\\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("anything", _AnyPath())

ROUTES: list[BaseRoute] = [
    Route("/v1/chat/completions", openai_route(chat_completions), methods=["POST"]),
    Route("/v1/responses", openai_route(create_response), methods=["POST"]),
    Route("/v1/responses/{response_id}", openai_route(retrieve_response), methods=["GET"]),
    Route("/v1/responses/{response_id}/cancel", openai_route(cancel_response), methods=["POST"]),
    Route("/v1/conversations", openai_route(conv.create_conversation), methods=["POST"]),
    Route("/v1/conversations/{conversation_id}", openai_route(conv.conversation_resource),
          methods=["GET", "POST", "DELETE"]),
    Route("/v1/conversations/{conversation_id}/items", openai_route(conv.items_resource), methods=["GET", "POST"]),
    Route("/v1/conversations/{conversation_id}/items/{item_id}", openai_route(conv.retrieve_item), methods=["GET"]),
    Route("/v1/models", openai_route(list_models), methods=["GET"]),
    Route("/v1/models/{model:anything}", openai_route(retrieve_model), methods=["GET"]),
]
