"""The grammar (llama.cpp GBNF) an answer is constrained to: a JSON value valid against a schema (``response_format``
json_object / json_schema), or a call of one of the tools a forced ``tool_choice`` allows, with arguments
valid against its parameters, in the Hermes syntax (generator.engines.tool_syntax).

Schemas are converted by rsb's own converter (generator.engines.schema_grammar), given only schemas
broker.schema.enforceable admits (checked again here: the request was checked at create, but by the code of whatever pod
took it). Each tool's rules carry a prefix of their own (``t0-``, ``t1-``), so two tools' definitions never
collide.
"""

from __future__ import annotations

from typing import Any

from broker.errors import InvalidRequest, Path, spelled
from broker.request.generation import GenerationRequest, Tool
from broker.request.tools import SCHEMA
from broker.schema.enforceable import check_enforceable
from generator.engines.base import EngineError
from generator.engines.schema_grammar import Grammar, GrammarTooBig, SchemaGrammar, literal
from generator.engines.tool_syntax import CLOSE, OPEN


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
    grammar = Grammar()
    root = _visit(grammar, schema, SCHEMA, "")
    return grammar.text(root)


def tool_call_grammar(tools: tuple[Tool, ...]) -> str:
    """One call, ``<tool_call>\\n{"name": "<name>", "arguments": <arguments>}\\n</tool_call>``, of one of
    ``tools``."""
    grammar = Grammar()
    alternatives = []
    for i, tool in enumerate(tools):
        rule = _visit(grammar, tool.arguments_schema, ("tools", i, "function", "parameters"), f"t{i}-")
        alternatives.append(f'{literal(tool.name + chr(34) + ", " + chr(34) + "arguments" + chr(34) + ": ")} {rule}')
    head = literal(OPEN + '\n{"name": "')
    return grammar.text(f'{head} ({" | ".join(alternatives)}) {literal("}" + chr(10) + CLOSE)}')


def _visit(grammar: Grammar, schema: Any, where: Path, prefix: str) -> str:
    try:
        check_enforceable(schema, where)
        return SchemaGrammar(grammar, schema, prefix).rule(schema)
    except InvalidRequest as e:
        raise SchemaRefused(e.message) from None
    except GrammarTooBig as e:
        raise SchemaRefused(f"{spelled(where)}: {e}") from None
