"""The Responses API's shapes of tools, tool choice and output format, to and from Chat Completions' shapes
(rsb's own create fields are Chat Completions'). The two APIs say the same things two ways: a Responses tool is
``{"type": "function", "name", "parameters", ...}`` where a chat tool nests them under ``function``; a forced
call is ``{"type": "function", "name"}`` against ``{"type": "function", "function": {"name"}}``; and
``text.format`` is ``response_format`` with the ``json_schema`` fields one level up.

Requests are translated shape by shape and validated by rsb's one validator (broker.request.generation), so a wrong
value gets the same message whichever API sent it; only what the Responses API has and rsb cannot honour (hosted
tools: web search, file search, ...) is refused here.
"""

from __future__ import annotations

from typing import Any

from broker.request.generation import GenerationRequest
from consumer.views.openai.common import invalid

#: The fields of a Responses function tool that a chat tool nests under ``function``.
_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
#: The fields of a Responses ``json_schema`` text format that ``response_format`` nests under ``json_schema``.
_SCHEMA_FIELDS = ("name", "schema", "strict", "description")


def chat_tools(raw: object) -> object:
    """Responses ``tools`` as chat ``tools`` (anything but a list of function tools is refused)."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise invalid("'tools' must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid(f"tools[{i}]: only function tools are supported, not {kind!r}", "tools")
        assert isinstance(tool, dict)
        unknown = sorted(set(tool) - {"type", *_FUNCTION_FIELDS})
        if unknown:
            raise invalid(f"tools[{i}]: unknown field(s): {', '.join(unknown)}", "tools")
        out.append({"type": "function", "function": {k: tool[k] for k in _FUNCTION_FIELDS if tool.get(k) is not None}})
    return out


def chat_tool_choice(raw: object) -> object:
    """A Responses ``tool_choice`` as a chat one: a mode, or a named function."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and set(raw) <= {"type", "name"}:
        return {"type": "function", "function": {"name": raw.get("name")}}
    kind = raw.get("type") if isinstance(raw, dict) else type(raw).__name__
    raise invalid(f"'tool_choice' must be auto, none, required or {{\"type\": \"function\", \"name\"}} "
                  f"(not {kind!r})", "tool_choice")


def response_format(text: object) -> object:
    """``text.format`` as ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid("'text' must be an object", "text")
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise invalid(f"text: unknown field(s): {', '.join(unknown)}", "text")
    if text.get("verbosity") is not None:
        raise invalid("'text.verbosity' is not supported (the model's answers have one length)", "text")
    fmt = text.get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt  # null, text, json_object, or wrong: rsb's validator says what is wrong with it
    unknown = sorted(set(fmt) - {"type", *_SCHEMA_FIELDS})
    if unknown:
        raise invalid(f"text.format: unknown field(s): {', '.join(unknown)}", "text")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in _SCHEMA_FIELDS if k in fmt}}


# -- the other way: what a Response object says about the request it answers -----------------------------


def responses_tools(req: GenerationRequest | None) -> list[dict[str, Any]]:
    if req is None:
        return []
    out = []
    for tool in req.tools:
        fn = tool.as_openai()["function"]
        out.append({"type": "function", "name": fn["name"], "description": fn.get("description"),
                    "parameters": fn["parameters"], "strict": tool.strict})
    return out


def responses_tool_choice(req: GenerationRequest | None) -> str | dict[str, Any]:
    """The request's tool choice; rsb stores OpenAI's defaults as none given: auto with tools, else none."""
    if req is None or req.tool_choice is None:
        return "auto" if req is not None and req.tools else "none"
    if req.tool_choice.mode == "function":
        return {"type": "function", "name": req.tool_choice.name}
    return req.tool_choice.mode


def text_config(req: GenerationRequest | None) -> dict[str, Any]:
    rf = req.response_format if req is not None else None
    if rf is None:
        return {"format": {"type": "text"}}
    if rf.type != "json_schema":
        return {"format": {"type": rf.type}}
    return {"format": {"type": "json_schema", "name": rf.name, "schema": rf.schema, "strict": rf.strict,
                       "description": rf.description}}
