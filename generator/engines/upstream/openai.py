"""The OpenAI-compatible protocol: vLLM, llama.cpp's server, llama-cpp-python's server, Ollama's ``/v1``,
OpenAI itself. ``messages`` requests go to ``POST /v1/chat/completions``, ``prompt`` requests to
``POST /v1/completions``, both with ``stream: true`` (server-sent events, read with broker.sse) and
``stream_options.include_usage`` so servers that can report usage do.

Typed output passes through as OpenAI spells it: ``tools``, ``tool_choice``, ``response_format``, tool
messages and assistant ``tool_calls`` on the way up (and ``prompt_cache_key``, OpenAI's prompt cache
routing); ``delta.tool_calls`` pieces, ``delta.reasoning_content`` (vLLM before 0.10, DeepSeek, llama.cpp's
server) or ``delta.reasoning`` (vLLM 0.10+, OpenRouter) on the way down. Whether the server enforces a
``response_format`` schema or a forced ``tool_choice`` is the server's affair (vLLM and llama.cpp's server
do; a server that ignores them answers free text)."""

from __future__ import annotations

import json
from typing import Any

from broker.request.generation import GenerationRequest
from broker.sse import LineDecoder
from generator.engines.base import UpstreamError
from generator.engines.pieces import TokenLogprob
from generator.engines.upstream.protocol import (
    CallPiece,
    Chunk,
    LineReader,
    UpstreamProtocol,
    UpstreamRefused,
    UpstreamRequest,
    continued_messages,
    error_message,
    int_or_none,
    map_finish_reason,
    str_or_none,
)


class OpenAIProtocol(UpstreamProtocol):
    name = "openai"
    root_suffix = "/v1"
    models_path = "/v1/models"

    def build_request(self, request: GenerationRequest, *, prefix_text: str, max_tokens: int, model: str | None,
                      cache_scope: str = "") -> UpstreamRequest:
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
        sampling = request.sampling.stored()
        sampling.pop("max_tool_calls", None)  # a Responses parameter: the answer is cut past it (generator.answer)
        if "parallel_tool_calls" in sampling and not (request.messages is not None and request.tools):
            del sampling["parallel_tool_calls"]
        if request.sampling.logprobs and request.messages is None:
            raise UpstreamRefused("logprobs of a prompt (not messages) through an OpenAI-compatible upstream: the "
                                  "legacy completions API has another shape")
        body.update(sampling)
        # OpenAI routes requests sharing a prompt_cache_key to the machine holding their prefix; vLLM and
        # llama.cpp's servers ignore it. The chat's digest (broker.request.generation: its conversation, the client's
        # own key or its leading messages; nothing of the prompt itself), within the cache scope: two tenants
        # naming the same key share no machine's cache through it.
        body["prompt_cache_key"] = f"rsb-{request.affinity(cache_scope)}"
        if request.stop:
            body["stop"] = list(request.stop)
        if request.response_format is not None:
            body["response_format"] = request.response_format.as_openai()
        if request.messages is not None and request.tools:
            body["tools"] = [t.as_openai() for t in request.tools]
            if request.tool_choice is not None:
                body["tool_choice"] = request.tool_choice.as_openai()
        if request.messages is not None:
            body["messages"] = continued_messages(request, prefix_text)
            return UpstreamRequest("/v1/chat/completions", body, chat=True)
        body["prompt"] = (request.prompt or "") + prefix_text
        return UpstreamRequest("/v1/completions", body, chat=False)

    def reader(self, *, chat: bool) -> LineReader:
        return _SSEReader(chat)

    def first_model(self, listing: Any) -> str | None:
        listed = listing.get("data") or []
        first = listed[0].get("id") if listed else None
        return first if isinstance(first, str) and first else None


class _SSEReader(LineReader):
    def __init__(self, chat: bool) -> None:
        self._decoder = LineDecoder()
        self._chat = chat

    def feed(self, line: str) -> Chunk | None:
        block = self._decoder.feed(line)
        # Only events with data matter; comments (keep-alives) and bare fields do not.
        if block is not None and block.is_event:
            return parse_event(block.data, chat=self._chat)
        return None


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
    thought: str | None = None
    calls: tuple[CallPiece, ...] = ()
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        # The opening {"role": "assistant"} (vLLM adds "content": "") announces the turn: not a token.
        if "role" in delta and not text:
            text = None
        thought = str_or_none(delta.get("reasoning_content")) or str_or_none(delta.get("reasoning"))
        raw_calls = delta.get("tool_calls")
        if isinstance(raw_calls, list):
            calls = tuple(_call_piece(c, i) for i, c in enumerate(raw_calls) if isinstance(c, dict))
        probs = _logprobs(choice.get("logprobs"))
    else:
        text = choice.get("text")
        probs = ()
    # The record that carries the finish reason is a token only if it carries text (vLLM); llama.cpp's
    # servers send an empty one after the last token.
    if finish is not None and not text:
        text = None
    # vLLM names the stop string that ended the answer (or the stop token's id, a number: not a stop sequence).
    stop_reason = choice.get("stop_reason")
    return Chunk(piece=text if isinstance(text, str) else None,
                 finish_reason=map_finish_reason(finish) if finish is not None else None,
                 prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, reasoning=thought or None,
                 calls=calls, logprobs=probs, stop_sequence=stop_reason if isinstance(stop_reason, str) else None)


def _logprobs(raw: object) -> tuple[TokenLogprob, ...]:
    """``choices[0].logprobs.content`` of a chunk, as markers (what is not well formed is left out)."""
    content = raw.get("content") if isinstance(raw, dict) else None
    out: list[TokenLogprob] = []
    for e in content if isinstance(content, list) else ():
        if not (isinstance(e, dict) and isinstance(e.get("token"), str) and isinstance(e.get("logprob"), int | float)):
            continue
        top = tuple((str(t.get("token")), float(t.get("logprob", 0.0)), tuple(t.get("bytes") or ()))
                    for t in e.get("top_logprobs") or () if isinstance(t, dict))
        out.append(TokenLogprob(e["token"], float(e["logprob"]), tuple(e.get("bytes") or ()), top))
    return tuple(out)


def _call_piece(raw: dict[str, Any], position: int) -> CallPiece:
    fn = raw.get("function")
    fn = fn if isinstance(fn, dict) else {}
    index = int_or_none(raw.get("index"))
    return CallPiece(index=position if index is None else index, id=str_or_none(raw.get("id")) or None,
                     name=str_or_none(fn.get("name")) or None, arguments=str_or_none(fn.get("arguments")))


OPENAI = OpenAIProtocol()
