"""The grammar (llama.cpp GBNF) an answer is constrained to: a JSON value valid against a schema (``response_format``
json_object / json_schema), or a call of one of the tools a forced ``tool_choice`` allows, with arguments
valid against its parameters, in the Hermes syntax (generator.engines.tool_syntax).

Schemas are converted by llama-cpp-python's port of llama.cpp's JSON-schema-to-grammar converter, given only
schemas broker.json_schema admits (checked again here: the request was checked at create, but by the code of
whatever pod took it). What rsb fixes in the converter's output: its strings admit raw control characters and
its ``.`` admits quotes, either of which makes the JSON invalid, so both rules are replaced by ones that admit
only what a JSON string may hold unescaped (and only whole Unicode scalar values); and ``$defs`` are renamed
(``d0``, ``d1``, ...) so that recursive references to names with other characters than letters, digits and
``-`` resolve, and two tools' definitions never collide.
"""

from __future__ import annotations

from typing import Any

from llama_cpp.llama_grammar import SchemaConverter

from broker.errors import InvalidRequest
from broker.json_schema import check_enforceable, for_grammar
from broker.request import GenerationRequest, Tool
from generator.engines.base import EngineError
from generator.engines.tool_syntax import CLOSE, OPEN

# What a JSON string holds unescaped: no quote, backslash or control character, and only Unicode scalar values
# (no surrogate, nothing past U+10FFFF: llama.cpp's decoder would take those bytes, a UTF-8 decoder would not).
_UNESCAPED = r"[\x20-\x21\x23-\x5B\x5D-\x7E\u0080-\uD7FF\uE000-\U0010FFFF]"
_CHAR = _UNESCAPED + r' | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
_DOT = _UNESCAPED


class SchemaRefused(EngineError):
    """The schema is one rsb cannot enforce (the create would have refused it)."""

    code = "invalid_request"


def answer_grammar(request: GenerationRequest) -> str | None:
    """The grammar of ``request``'s answer, or None when it is free text."""
    forced = request.forced_tools
    if forced:
        return tool_call_grammar(forced)
    rf = request.response_format
    if rf is None:
        return None
    schema = {"type": "object"} if rf.type == "json_object" else rf.schema
    converter = _converter()
    root = _visit(converter, schema, "response_format.json_schema.schema", "")
    return _format(converter, None if root == "root" else f"root ::= {root}")


def tool_call_grammar(tools: tuple[Tool, ...]) -> str:
    """One call, ``<tool_call>\\n{"name": "<name>", "arguments": <arguments>}\\n</tool_call>``, of one of
    ``tools``."""
    converter = _converter()
    alternatives = []
    for i, tool in enumerate(tools):
        rule = _visit(converter, tool.arguments_schema, f"tools[{i}].function.parameters", f"t{i}-args", f"t{i}")
        alternatives.append(f'"{tool.name}\\", \\"arguments\\": " {rule}')
    head = _literal(OPEN + '\n{"name": "')
    root = f'root ::= {head} ({" | ".join(alternatives)}) {_literal("}" + chr(10) + CLOSE)}'
    return _format(converter, root)


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _converter() -> SchemaConverter:
    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _visit(converter: SchemaConverter, schema: Any, where: str, name: str, defs_prefix: str = "") -> str:
    try:
        check_enforceable(schema, where)
    except InvalidRequest as e:
        raise SchemaRefused(e.message) from None
    prepared = _rename_defs(for_grammar(schema), defs_prefix)
    try:
        resolved = converter.resolve_refs(prepared, f"{name or 'root'}.json")
        rule: str = converter.visit(resolved, name)
    except (AssertionError, ValueError, KeyError, RecursionError) as e:
        raise SchemaRefused(f"{where}: the grammar converter refused it ({type(e).__name__}: {e})") from None
    return rule


def _format(converter: SchemaConverter, root: str | None) -> str:
    rules: dict[str, str] = converter._rules  # the converter exposes no other way to amend its rules
    if "char" in rules:
        rules["char"] = _CHAR
    if "dot" in rules:
        rules["dot"] = _DOT
    grammar: str = converter.format_grammar()
    return grammar if root is None else grammar + "\n" + root


def _rename_defs(schema: Any, prefix: str) -> Any:
    """Move every definition to ``$defs`` under a name the converter's rule names keep as they are, and point
    every reference at its new name."""
    if not isinstance(schema, dict):
        return schema
    names: dict[str, str] = {}
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        for old, sub in (schema.get(key) or {}).items():
            new = f"{prefix}d{len(names)}"
            names[f"#/{key}/{old}"] = f"#/$defs/{new}"
            defs[new] = sub

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            if isinstance(node.get("$ref"), str):
                out["$ref"] = names.get(node["$ref"], node["$ref"])
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    out = rewrite(schema)
    if defs:
        out["$defs"] = {k: rewrite(v) for k, v in defs.items()}
    return out
