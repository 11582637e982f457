"""The OpenAI-compatible protocol: vLLM, llama.cpp's server, llama-cpp-python's server, Ollama's ``/v1``,
OpenAI itself. ``messages`` requests go to ``POST /v1/chat/completions``, ``prompt`` requests to
``POST /v1/completions``, both with ``stream: true`` (server-sent events, read with broker.sse) and
``stream_options.include_usage`` so servers that can report usage do."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from broker.request import GenerationRequest
from broker.sse import LineDecoder
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


class OpenAIProtocol(UpstreamProtocol):
    name = "openai"
    root_suffix = "/v1"
    models_path = "/v1/models"

    def build_request(self, request: GenerationRequest, *, prefix_text: str, max_tokens: int, model: str | None,
                      ignore_eos: bool = False) -> UpstreamRequest:
        body: dict[str, Any] = {
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
        }
        if model:
            body["model"] = model
        if request.seed is not None:
            body["seed"] = request.seed
        if request.stop:
            body["stop"] = list(request.stop)
        if ignore_eos:  # a vLLM / llama.cpp server extension; other servers ignore unknown fields
            body["ignore_eos"] = True
        if request.messages is not None:
            body["messages"] = continued_messages(request, prefix_text)
            return UpstreamRequest("/v1/chat/completions", body, chat=True)
        body["prompt"] = (request.prompt or "") + prefix_text
        return UpstreamRequest("/v1/completions", body, chat=False)

    def chunks(self, lines: Iterable[str], *, chat: bool) -> Iterator[Chunk]:
        decoder = LineDecoder()
        for line in lines:
            block = decoder.feed(line)
            # Only events with data matter; comments (keep-alives) and bare fields do not.
            if block is not None and block.is_event:
                yield parse_event(block.data, chat=chat)

    def first_model(self, listing: Any) -> str | None:
        listed = listing.get("data") or []
        first = listed[0].get("id") if listed else None
        return first if isinstance(first, str) and first else None


def parse_event(data: str, *, chat: bool) -> Chunk:
    """One SSE ``data`` payload of an OpenAI-compatible stream. Raises UpstreamError on an error event."""
    if data.strip() == "[DONE]":
        return Chunk(done=True)
    try:
        obj = json.loads(data)
    except ValueError:
        raise UpstreamError(f"upstream sent an event that is not JSON: {data[:200]!r}") from None
    if not isinstance(obj, dict):
        raise UpstreamError(f"upstream sent an unexpected event: {data[:200]!r}")
    if "error" in obj:  # vLLM and llama.cpp report failures mid-stream this way
        raise UpstreamError(f"upstream error: {error_message(obj['error'])}")
    raw_usage = obj.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    prompt_tokens = int_or_none(usage.get("prompt_tokens"))
    completion_tokens = int_or_none(usage.get("completion_tokens"))
    choices = obj.get("choices") or []
    if not choices:  # the include_usage record: usage only
        return Chunk(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    choice = choices[0]
    finish = choice.get("finish_reason")
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        # The opening {"role": "assistant"} (vLLM adds "content": "") announces the turn: not a token.
        if "role" in delta and not text:
            text = None
    else:
        text = choice.get("text")
    # The record that carries the finish reason is a token only if it carries text (vLLM); llama.cpp's
    # servers send an empty one after the last token.
    if finish is not None and not text:
        text = None
    return Chunk(piece=text if isinstance(text, str) else None,
                 finish_reason=map_finish_reason(finish) if finish is not None else None,
                 prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


OPENAI = OpenAIProtocol()
