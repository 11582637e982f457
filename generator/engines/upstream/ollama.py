"""Ollama's native protocol: ``POST /api/chat`` and ``POST /api/generate`` (``raw``, so a prompt is
completed as given, like the local engine does), streamed as NDJSON."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from broker.request import GenerationRequest
from generator.engines.base import UpstreamError
from generator.engines.upstream.protocol import (
    Chunk,
    UpstreamProtocol,
    UpstreamRequest,
    continued_messages,
    error_message,
    int_or_none,
    map_finish_reason,
)


class OllamaProtocol(UpstreamProtocol):
    name = "ollama"
    root_suffix = "/api"
    models_path = "/api/tags"

    def build_request(self, request: GenerationRequest, *, prefix_text: str, max_tokens: int, model: str | None,
                      ignore_eos: bool = False) -> UpstreamRequest:
        options: dict[str, Any] = {
            "num_predict": max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
        }
        if request.seed is not None:
            options["seed"] = request.seed
        if request.stop:
            options["stop"] = list(request.stop)
        body: dict[str, Any] = {"model": model or "", "stream": True, "options": options}
        if request.messages is not None:
            body["messages"] = continued_messages(request, prefix_text)
            return UpstreamRequest("/api/chat", body, chat=True)
        # raw: the prompt is completed as given (no template), like the local engine completes a prompt.
        body["prompt"] = (request.prompt or "") + prefix_text
        body["raw"] = True
        return UpstreamRequest("/api/generate", body, chat=False)

    def chunks(self, lines: Iterable[str], *, chat: bool) -> Iterator[Chunk]:
        for line in lines:
            if line.strip():
                yield parse_line(line, chat=chat)

    def first_model(self, listing: Any) -> str | None:
        listed = listing.get("models") or []
        first = listed[0].get("name") if listed else None
        return first if isinstance(first, str) and first else None


def parse_line(line: str, *, chat: bool) -> Chunk:
    """One NDJSON line of an Ollama native stream. Raises UpstreamError on an error record."""
    try:
        obj = json.loads(line)
    except ValueError:
        raise UpstreamError(f"upstream sent a line that is not JSON: {line[:200]!r}") from None
    if not isinstance(obj, dict):
        raise UpstreamError(f"upstream sent an unexpected line: {line[:200]!r}")
    if "error" in obj:
        raise UpstreamError(f"upstream error: {error_message(obj['error'])}")
    if chat:
        message = obj.get("message") or {}
        text = message.get("content") if isinstance(message, dict) else None
    else:
        text = obj.get("response")
    if obj.get("done"):
        return Chunk(piece=text or None, finish_reason=map_finish_reason(obj.get("done_reason")),
                     prompt_tokens=int_or_none(obj.get("prompt_eval_count")),
                     completion_tokens=int_or_none(obj.get("eval_count")), done=True)
    return Chunk(piece=text if isinstance(text, str) else None)


OLLAMA = OllamaProtocol()
