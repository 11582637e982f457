"""Ollama's native protocol: ``POST /api/chat`` and ``POST /api/generate`` (``raw``, so a prompt is
completed as given, like the local engine does), streamed as NDJSON.

Typed output: ``tools`` go up in OpenAI's shape (which Ollama reads), a ``json_schema`` response format as
``format`` (the schema itself; ``json_object`` as ``"json"``), assistant tool calls as ``tool_calls`` with
their arguments as an object, tool results as ``tool`` messages naming the tool (``tool_name``). Down:
``message.thinking`` is reasoning, ``message.tool_calls`` arrive whole (name and arguments object in one
record), each becoming a call with the arguments as JSON text, and an answer with calls ends with
``tool_calls``. Ollama has no ``tool_choice``: a forced one is passed as nothing (Ollama decides)."""

from __future__ import annotations

import json
from typing import Any

from broker.request.generation import GenerationRequest
from generator.engines.base import UpstreamError
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
    new_call_id,
    str_or_none,
)


class OllamaProtocol(UpstreamProtocol):
    name = "ollama"
    root_suffix = "/api"
    models_path = "/api/tags"

    def build_request(self, request: GenerationRequest, *, prefix_text: str, max_tokens: int, model: str | None,
                      cache_scope: str = "") -> UpstreamRequest:
        options: dict[str, Any] = {
            "num_predict": max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
        }
        if request.seed is not None:
            options["seed"] = request.seed
        sampling = request.sampling
        if sampling.logit_bias:
            raise UpstreamRefused("Ollama's API has no 'logit_bias'")
        if sampling.logprobs:
            raise UpstreamRefused("rsb reads no logprobs from Ollama's API")
        if sampling.presence_penalty:
            options["presence_penalty"] = sampling.presence_penalty
        if sampling.frequency_penalty:
            options["frequency_penalty"] = sampling.frequency_penalty
        if sampling.top_k is not None:
            options["top_k"] = sampling.top_k
        if request.stop:
            options["stop"] = list(request.stop)
        body: dict[str, Any] = {"model": model or "", "stream": True, "options": options}
        rf = request.response_format
        if rf is not None:
            body["format"] = rf.schema if rf.type == "json_schema" else "json"
        if request.messages is not None:
            body["messages"] = ollama_messages(continued_messages(request, prefix_text))
            if request.offers_tools:
                body["tools"] = [t.as_openai() for t in request.tools]
            return UpstreamRequest("/api/chat", body, chat=True)
        # raw: the prompt is completed as given (no template), like the local engine completes a prompt.
        body["prompt"] = (request.prompt or "") + prefix_text
        body["raw"] = True
        return UpstreamRequest("/api/generate", body, chat=False)

    def reader(self, *, chat: bool) -> LineReader:
        return _NDJSONReader(chat)

    def first_model(self, listing: Any) -> str | None:
        listed = listing.get("models") or []
        first = listed[0].get("name") if listed else None
        return first if isinstance(first, str) and first else None


def ollama_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages as Ollama's chat reads them: call arguments as objects, no call ids, tool
    results naming their tool."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                names[c["id"]] = c["function"]["name"]
                calls.append({"function": {"name": c["function"]["name"],
                                           "arguments": _arguments_object(c["function"]["arguments"])}})
            m["tool_calls"] = calls
            m["content"] = m.get("content") or ""
        if m["role"] == "tool":
            call_id = m.pop("tool_call_id", None)
            if call_id in names:
                m["tool_name"] = names[call_id]
        out.append(m)
    return out


def _arguments_object(text: str) -> Any:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}  # arguments a model wrote that are not JSON: Ollama takes only an object
    return value if isinstance(value, dict) else {}


class _NDJSONReader(LineReader):
    def __init__(self, chat: bool) -> None:
        self._chat = chat
        self._calls = 0
        self._any_call = False

    def feed(self, line: str) -> Chunk | None:
        if not line.strip():
            return None
        chunk = parse_line(line, chat=self._chat, first_index=self._calls)
        self._calls += len(chunk.calls)
        self._any_call = self._any_call or bool(chunk.calls)
        if chunk.done and self._any_call and chunk.finish_reason == "stop":
            # Ollama says "stop" after calls too; the contract says tool_calls.
            chunk = Chunk(piece=chunk.piece, finish_reason="tool_calls", prompt_tokens=chunk.prompt_tokens,
                          completion_tokens=chunk.completion_tokens, done=True, reasoning=chunk.reasoning)
        return chunk


def parse_line(line: str, *, chat: bool, first_index: int = 0) -> Chunk:
    """One NDJSON line of an Ollama native stream. Raises UpstreamError on an error record."""
    try:
        obj = json.loads(line)
    except ValueError:
        raise UpstreamError(f"upstream sent a line that is not JSON: {line[:200]!r}") from None
    if not isinstance(obj, dict):
        raise UpstreamError(f"upstream sent an unexpected line: {line[:200]!r}")
    if "error" in obj:
        raise UpstreamError(f"upstream error: {error_message(obj['error'])}")
    thought: str | None = None
    calls: tuple[CallPiece, ...] = ()
    if chat:
        message = obj.get("message") or {}
        message = message if isinstance(message, dict) else {}
        text = message.get("content")
        thought = str_or_none(message.get("thinking")) or None
        raw_calls = message.get("tool_calls")
        if isinstance(raw_calls, list):
            calls = tuple(_call(c, first_index + i) for i, c in enumerate(raw_calls) if isinstance(c, dict))
    else:
        text = obj.get("response")
        thought = str_or_none(obj.get("thinking")) or None
    if obj.get("done"):
        return Chunk(piece=text or None, finish_reason=map_finish_reason(obj.get("done_reason")),
                     prompt_tokens=int_or_none(obj.get("prompt_eval_count")),
                     completion_tokens=int_or_none(obj.get("eval_count")), done=True, reasoning=thought, calls=calls)
    return Chunk(piece=text if isinstance(text, str) else None, reasoning=thought, calls=calls)


def _call(raw: dict[str, Any], index: int) -> CallPiece:
    fn = raw.get("function")
    fn = fn if isinstance(fn, dict) else {}
    args = fn.get("arguments")
    text = args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)
    return CallPiece(index=index, id=str_or_none(raw.get("id")) or new_call_id(),
                     name=str_or_none(fn.get("name")) or "", arguments=text)


OLLAMA = OllamaProtocol()
