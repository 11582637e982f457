"""Anthropic's Messages request as rsb's create: the body is translated field by field into a ``POST /v1/streams``
body and validated by rsb's one validator (broker.request.generation), as every view's is. What rsb cannot honour is a
400 naming it, never ignored:

    Messages request                             rsb create
    system (a string, or text blocks)            a leading ``system`` message
    messages[] of role system                    a ``system`` message there (its text)
    messages[].content: a string, or blocks:
      text                                       the message's text (its text blocks joined)
      tool_use (assistant)                       a tool call of the assistant message (id, name, input as JSON text)
      tool_result (user)                         a ``tool`` message (tool_use_id, its text; ``is_error``: "Error: "
                                                 before it), ahead of the user's own text
      thinking, redacted_thinking (assistant)    dropped: a model is not given its past reasoning
    tools: custom tools {name, description,      tools: {type: function, function: {name, description, parameters,
      input_schema, strict}                      strict}}
    tool_choice auto | any | tool | none         tool_choice auto | required | {function: name} | none;
      (disable_parallel_tool_use)                parallel_tool_calls: false
    stop_sequences, max_tokens, temperature,     stop, max_tokens, temperature, top_p, top_k
      top_p, top_k
    metadata.user_id                             user (kept with the request, shown nowhere)
    service_tier auto | standard_only            service_tier auto | default
    output_config.format (json_schema)           response_format json_schema (the answer's text is the JSON)
    thinking enabled | adaptive                  the model's reasoning is shown as thinking blocks (message ids
                                                 say so: consumer.views.anthropic.message)

Images, documents and other non-text blocks, server tools (web search, code execution, ...), a final assistant
message (prefill), ``output_config.effort`` and the other platform features are refused by name. ``cache_control``
is accepted wherever Anthropic takes it: rsb's prompt cache keeps recent prompts by itself (per tenant)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from broker.errors import ANY, InvalidRequest, Path
from broker.request.generation import MAX_TOOLS, GenerationRequest, RequestLimits, validate_create_body
from consumer.views.anthropic.errors import AnthropicError, invalid

#: Anthropic's lower bound on a thinking budget (its API reference); the budget is a target the model's own
#: reasoning is not held to (rsb cannot stop a model's reasoning early): validated as Anthropic does, not enforced.
MIN_THINKING_BUDGET = 1024
MAX_USER_ID_CHARS = 256
#: Content blocks per message allowed on average (text, tool calls and their results: an agent's turn has a few).
BLOCKS_PER_MESSAGE = 8
#: Text blocks of one system prompt or tool result, at most.
MAX_TEXT_BLOCKS = 1024
#: The name rsb's response_format gives the schema of ``output_config.format`` (Anthropic's has none).
OUTPUT_SCHEMA_NAME = "output"
#: Parameters of Anthropic's API for platform features rsb does not have: refused unless null.
PLATFORM_FEATURES = ("container", "mcp_servers", "context_management", "inference_geo", "diagnostics", "fallbacks",
                     "thread", "safeguards", "compaction", "user_profile_id", "workspace_id")
#: Every parameter a Messages create may carry.
KNOWN = frozenset({"model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences",
                   "temperature", "top_p", "top_k", "metadata", "thinking", "stream", "service_tier",
                   "output_config", "cache_control", "speed", *PLATFORM_FEATURES})
SERVICE_TIERS = {"auto": "auto", "standard_only": "default"}
#: rsb's fields, as this API names them (InvalidRequest.said).
RENAMES: dict[Path, Path] = {
    ("stop",): ("stop_sequences",), ("tools", ANY, "function", "parameters"): ("tools", ANY, "input_schema"),
    ("tools", ANY, "function"): ("tools", ANY), ("response_format", "json_schema"): ("output_config", "format"),
    ("response_format",): ("output_config", "format"), ("user",): ("metadata", "user_id")}


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A Messages create: the generation it asks for, whether it streams, and whether the model's reasoning is
    shown (thinking blocks)."""

    generation: GenerationRequest
    stream: bool
    thinking: bool


def parse_messages_request(body: dict[str, Any], limits: RequestLimits) -> MessagesRequest:
    """Validate a Messages create body. Raises AnthropicError (400) naming what is wrong or cannot be honoured."""
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise invalid(f"{unknown[0]}: Extra inputs are not permitted")
    for name in PLATFORM_FEATURES:
        if body.get(name) is not None:
            raise invalid(f"{name}: not supported by rsb (a platform feature of Anthropic's API)")
    for name in ("model", "max_tokens", "messages"):
        if body.get(name) is None:
            raise invalid(f"{name}: Field required")
    if body.get("speed") not in (None, "standard"):
        raise invalid("speed: only 'standard' is supported")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream: must be true or false")
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, int | float)
                                    or not 0 <= temperature <= 1):
        raise invalid("temperature: must be a number between 0 and 1")
    _cache_control(body.get("cache_control"), "cache_control")
    _bounded(body, limits)
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"))
    if choice.get("tool_choice") == "required" and not tools:
        raise invalid("tool_choice: 'any' needs 'tools'")
    rsb: dict[str, Any] = {
        "model": body["model"], "max_tokens": body["max_tokens"], "temperature": temperature,
        "top_p": body.get("top_p"), "top_k": body.get("top_k"), "stop": body.get("stop_sequences"),
        "messages": [*_system(body.get("system")), *_messages(body["messages"])],
        "user": _user_id(body.get("metadata")), "service_tier": _service_tier(body.get("service_tier")),
        "response_format": _output_format(body.get("output_config")), "tools": tools,
        **choice}
    try:
        _, generation = validate_create_body({k: v for k, v in rsb.items() if v is not None}, limits)
    except InvalidRequest as e:
        raise invalid(e.said(RENAMES)[0]) from None
    return MessagesRequest(generation, bool(stream), _thinking(body.get("thinking"), generation.max_tokens))


def _bounded(body: dict[str, Any], limits: RequestLimits) -> None:
    """What the loops below walk, bounded before any of them runs (rsb's own limits apply again to the create)."""
    messages, tools, system = body["messages"], body.get("tools"), body.get("system")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise invalid(f"messages: at most {limits.max_messages} messages")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise invalid(f"tools: at most {MAX_TOOLS} tools")
    blocks = (len(system) if isinstance(system, list) else 0) + sum(
        len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)) \
        if isinstance(messages, list) else 0
    if blocks > max_blocks(limits):
        raise invalid(f"messages: at most {max_blocks(limits)} content blocks in all")


def max_blocks(limits: RequestLimits) -> int:
    """The content blocks a request may hold in all (its messages', its system's, a tool result's)."""
    return BLOCKS_PER_MESSAGE * limits.max_messages


def _object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"{where}: must be an object")
    return value


def _only(block: Mapping[str, Any], where: str, allowed: frozenset[str]) -> None:
    unknown = sorted(set(block) - allowed)
    if unknown:
        raise invalid(f"{where}.{unknown[0]}: Extra inputs are not permitted")


def _cache_control(value: object, where: str) -> None:
    """Anthropic's ``{"type": "ephemeral", "ttl"?: "5m" | "1h"}``: accepted (rsb caches recent prompts by itself)."""
    if value is None:
        return
    cc = _object(value, where)
    if cc.get("type") != "ephemeral" or cc.get("ttl") not in (None, "5m", "1h") or set(cc) - {"type", "ttl"}:
        raise invalid(f"{where}: must be {{\"type\": \"ephemeral\", \"ttl\"?: \"5m\" | \"1h\"}}")


_TEXT_FIELDS = frozenset({"type", "text", "cache_control", "citations"})


def _text(block: dict[str, Any], where: str) -> str:
    _only(block, where, _TEXT_FIELDS)
    _cache_control(block.get("cache_control"), f"{where}.cache_control")
    if block.get("citations"):
        raise invalid(f"{where}.citations: not supported by rsb")
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text: must be a string")
    return text


def _kind(block: object, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise invalid(f"{where}: must be a content block (an object with a 'type')")
    return kind


def _texts(content: object, where: str) -> str:
    """A string, or text blocks (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or len(content) > MAX_TEXT_BLOCKS:
        raise invalid(f"{where}: must be a string or a list of at most {MAX_TEXT_BLOCKS} text blocks")
    out = []
    for j, block in enumerate(content):
        kind = _kind(block, f"{where}.{j}")
        if kind != "text":
            raise invalid(f"{where}.{j}: only text blocks are supported here, not {kind!r}")
        assert isinstance(block, dict)
        out.append(_text(block, f"{where}.{j}"))
    return "".join(out)


def _system(raw: object) -> list[dict[str, Any]]:
    if raw is None:
        return []
    return [{"role": "system", "content": _texts(raw, "system")}]


def _unsupported(kind: str, where: str) -> AnthropicError:
    return invalid(f"{where}: a {kind!r} block is not supported by rsb (its models read text, tool calls and tool "
                   "results)")


def _messages(raw: object) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise invalid("messages: must be a non-empty list")
    out: list[dict[str, Any]] = []
    asked: set[str] = set()  # the tool_use ids of the last assistant message, not answered yet
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        msg = _object(m, where)
        _only(msg, where, frozenset({"role", "content"}))
        role = msg.get("role")
        if role not in ("user", "assistant", "system"):
            raise invalid(f"{where}.role: must be 'user', 'assistant' or 'system'")
        content = msg.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise invalid(f"{where}.content: must be a string or a list of content blocks")
        if role != "user" and asked:
            raise _unanswered(where, asked)
        if role == "system":  # instructions in the middle of the conversation
            out.append({"role": "system", "content": _texts(content, f"{where}.content")})
        elif role == "assistant":
            message, asked = _assistant(blocks, f"{where}.content")
            out.append(message)
        else:
            messages, answered = _user_message(blocks, f"{where}.content", asked)
            out.extend(messages)
            missing = asked - answered
            if missing:
                raise _unanswered(where, missing)
            asked = set()
    if raw[-1].get("role") == "assistant":
        raise invalid("messages: the last message must be the user's (rsb cannot continue a final assistant "
                      "message: prefill is not supported)")
    return out


def _unanswered(where: str, ids: set[str]) -> AnthropicError:
    return invalid(f"{where}: tool_use ids were found without tool_result blocks immediately after: "
                   f"{', '.join(sorted(ids))[:200]}")


def _assistant(blocks: list[Any], where: str) -> tuple[dict[str, Any], set[str]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _kind(block, at)
        assert isinstance(block, dict)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            _only(block, at, frozenset({"type", "id", "name", "input", "cache_control", "caller"}))
            _cache_control(block.get("cache_control"), f"{at}.cache_control")
            if block.get("caller") not in (None, {"type": "direct"}):
                raise invalid(f"{at}.caller: only direct calls are supported")
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid(f"{at}: a tool_use block needs a string 'id' and 'name'")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": orjson.dumps(_object(block.get("input"), f"{at}.input")).decode()}})
        elif kind not in ("thinking", "redacted_thinking"):  # earlier reasoning: not given to the model
            raise _unsupported(kind, at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message, {c["id"] for c in calls}


def _user_message(blocks: list[Any], where: str, asked: set[str]) -> tuple[list[dict[str, Any]], set[str]]:
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _kind(block, at)
        assert isinstance(block, dict)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            _only(block, at, frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}))
            _cache_control(block.get("cache_control"), f"{at}.cache_control")
            call_id = block.get("tool_use_id")
            if call_id not in asked:
                raise invalid(f"{at}: unexpected `tool_use_id` found in `tool_result` blocks: {str(call_id)[:64]}. "
                              "Each `tool_result` block must have a corresponding `tool_use` block in the previous "
                              "message.")
            text = "" if block.get("content") is None else _texts(block["content"], f"{at}.content")
            is_error = block.get("is_error")
            if is_error not in (None, True, False):
                raise invalid(f"{at}.is_error: must be true or false")
            results.append({"role": "tool", "tool_call_id": call_id,
                            "content": f"Error: {text}" if is_error else text})
        else:
            raise _unsupported(kind, at)
    messages = [*results, *([{"role": "user", "content": "".join(texts)}] if texts or not results else [])]
    return messages, {r["tool_call_id"] for r in results}


def _user_id(metadata: object) -> str | None:
    if metadata is None:
        return None
    meta = _object(metadata, "metadata")
    _only(meta, "metadata", frozenset({"user_id"}))
    user_id = meta.get("user_id")
    if user_id is not None and (not isinstance(user_id, str) or len(user_id) > MAX_USER_ID_CHARS):
        raise invalid(f"metadata.user_id: must be a string of at most {MAX_USER_ID_CHARS} characters")
    return user_id


def _service_tier(raw: object) -> str | None:
    if raw is None:
        return None
    if raw not in SERVICE_TIERS:
        raise invalid(f"service_tier: must be one of {', '.join(SERVICE_TIERS)}")
    return SERVICE_TIERS[str(raw)]


def _output_format(raw: object) -> dict[str, Any] | None:
    if raw is None:
        return None
    config = _object(raw, "output_config")
    _only(config, "output_config", frozenset({"format", "effort", "task_budget"}))
    for name in ("effort", "task_budget"):
        if config.get(name) is not None:
            raise invalid(f"output_config.{name}: not supported by rsb (it cannot set how much a model reasons)")
    fmt = config.get("format")
    if fmt is None:
        return None
    fmt = _object(fmt, "output_config.format")
    _only(fmt, "output_config.format", frozenset({"type", "schema"}))
    if fmt.get("type") != "json_schema":
        raise invalid("output_config.format.type: must be 'json_schema'")
    return {"type": "json_schema", "json_schema": {"name": OUTPUT_SCHEMA_NAME, "schema": fmt.get("schema"),
                                                   "strict": True}}


_TOOL_FIELDS = frozenset({"type", "name", "description", "input_schema", "cache_control", "strict",
                          "eager_input_streaming", "defer_loading", "allowed_callers", "input_examples"})


def _tools(raw: object) -> list[dict[str, Any]] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise invalid("tools: must be a list of tools")
    out = []
    for i, t in enumerate(raw):
        where = f"tools.{i}"
        tool = _object(t, where)
        if tool.get("type") not in (None, "custom"):
            raise invalid(f"{where}: only custom tools (name, description, input_schema) are supported, not "
                          f"{str(tool.get('type'))[:64]!r} (rsb runs no server tool)")
        _only(tool, where, _TOOL_FIELDS)
        _cache_control(tool.get("cache_control"), f"{where}.cache_control")
        # Tool input streams piece by piece whatever this says (eager_input_streaming asks for that).
        if tool.get("eager_input_streaming") not in (None, True, False):
            raise invalid(f"{where}.eager_input_streaming: must be true or false")
        for name in ("defer_loading", "allowed_callers", "input_examples"):
            if tool.get(name) not in (None, False, []):
                raise invalid(f"{where}.{name}: not supported by rsb")
        if tool.get("input_schema") is None:
            raise invalid(f"{where}.input_schema: Field required")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        fn.update({k: tool[k] for k in ("description", "strict") if tool.get(k) is not None})
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: object) -> dict[str, Any]:
    """rsb's ``tool_choice`` and ``parallel_tool_calls`` for Anthropic's ``tool_choice``."""
    if raw is None:
        return {}
    choice = _object(raw, "tool_choice")
    kind = choice.get("type")
    _only(choice, "tool_choice", frozenset({"type", "disable_parallel_tool_use",
                                            *(("name",) if kind == "tool" else ())}))
    modes = {"auto": "auto", "any": "required", "none": "none"}
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise invalid("tool_choice.name: Field required")
        out: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    elif kind in modes:
        out = {"tool_choice": modes[str(kind)]}
    else:
        raise invalid("tool_choice.type: must be one of auto, any, tool, none")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel not in (None, True, False) or (parallel is not None and kind == "none"):
        raise invalid("tool_choice.disable_parallel_tool_use: must be true or false (not with 'none')")
    if parallel:
        out["parallel_tool_calls"] = False
    return out


def _thinking(raw: object, max_tokens: int) -> bool:
    """Whether the model's reasoning is shown (as thinking blocks)."""
    if raw is None:
        return False
    config = _object(raw, "thinking")
    kind = config.get("type")
    if kind == "disabled":
        _only(config, "thinking", frozenset({"type"}))
        return False
    if kind not in ("enabled", "adaptive"):
        raise invalid("thinking.type: must be one of enabled, adaptive, disabled")
    _only(config, "thinking", frozenset({"type", "display", *(("budget_tokens",) if kind == "enabled" else ())}))
    if kind == "enabled":
        budget = config.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
            raise invalid(f"thinking.budget_tokens: must be an integer of at least {MIN_THINKING_BUDGET}")
        if budget >= max_tokens:
            raise invalid("thinking.budget_tokens: must be less than max_tokens")
    display = config.get("display")
    if display not in (None, "summarized", "omitted"):
        raise invalid("thinking.display: must be 'summarized' or 'omitted'")
    return display != "omitted"
