"""The Vercel AI SDK view: ``useChat`` (``DefaultChatTransport``, ai@5, ai@6 and ai@7) works against rsb unchanged.

- ``POST /api/chat`` (the SDK's default ``api``): a chat turn, answered as the UI message stream;
- ``GET /api/chat/{chat_id}/stream`` (what ``resume: true`` sends on page load): the chat's active turn
  from its start, or 204;
- ``POST /api/chat/{chat_id}/stop``: stop the active turn (the SDK's ``stop()`` only aborts its fetch);
- ``GET /api/chat/{chat_id}/messages``: the chat's ``UIMessage`` s, for another device's ``useChat``.

A chat is a conversation (consumer.streaming.conversations): a turn is an rsb stream, made by the stream
service's create with the conversation's history in front of what the UI messages add to it, and read by its
reader. Nothing here is a second pipeline: the native routes see
the same streams (the assistant message's id is the stream id). docs/protocol.md describes the view.
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Route

from consumer.views.aisdk.routes import chat_messages, resume_turn, send_turn, stop_turn

ROUTES: list[BaseRoute] = [
    Route("/api/chat", send_turn, methods=["POST"]),
    # `path`: a chat id may hold a '/' (the SDK percent-encodes it; the path arrives decoded).
    Route("/api/chat/{chat_id:path}/stream", resume_turn, methods=["GET"]),
    Route("/api/chat/{chat_id:path}/stop", stop_turn, methods=["POST"]),
    Route("/api/chat/{chat_id:path}/messages", chat_messages, methods=["GET"]),
]
