"""Hermes tool-call syntax read out of a model's text, token by token: exact pieces, one plain string per
token, calls announced as soon as their name is known, anything that is no call left as text."""

from __future__ import annotations

import json

import pytest

from generator.engines.pieces import TEXT, Extra, Piece, ToolCallStart
from generator.engines.tool_syntax import ToolCallSyntax, call_text, closed_call_text, replay_text


def run(tokens: list[str]) -> tuple[list[Piece], ToolCallSyntax]:
    syntax = ToolCallSyntax()
    out: list[Piece] = []
    for t in tokens:
        pieces = syntax.feed(t)
        assert sum(type(p) is str for p in pieces) == 1, (t, pieces)  # one token, one plain string
        out += pieces
    return out + syntax.end(), syntax


def squash(pieces: list[Piece]) -> list[object]:
    """Markers kept (ids dropped), text between them joined."""
    out: list[object] = []
    for p in pieces:
        if isinstance(p, str):
            if out and isinstance(out[-1], str):
                out[-1] += p
            elif p:
                out.append(str(p))
        elif isinstance(p, ToolCallStart):
            out.append(("call", p.index, p.name))
        else:
            out.append(p)
    return out


def chars(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


ANSWER = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } in \\" it"}}'
          '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50])
def test_calls_stream_whatever_the_token_boundaries(size: int) -> None:
    pieces, syntax = run(chars(ANSWER, size))
    assert squash(pieces) == ["Let me look. ", ("call", 0, "get_weather"), '{"city": "Paris", "note": "a } in \\" it"}',
                              ("call", 1, "get_time"), "{}"]
    assert syntax.calls == 2
    ids = [p.id for p in pieces if isinstance(p, ToolCallStart)]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_the_name_is_announced_before_the_arguments_are_written() -> None:
    syntax = ToolCallSyntax()
    assert squash(syntax.feed('<tool_call>\n{"name": "f')) == []
    assert squash(syntax.feed('", "arguments": {"a')) == [("call", 0, "f"), '{"a']


def test_text_that_only_looks_like_a_tag_is_text() -> None:
    pieces, syntax = run(["a <tool", "_cal", "lx> b <", "tool"])
    assert squash(pieces) == ["a <tool_callx> b <tool"] and syntax.calls == 0


def test_a_call_written_arguments_first_is_read_whole_and_junk_stays_text() -> None:
    pieces, _ = run(chars('<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>ok', 4))
    assert squash(pieces) == [("call", 0, "f"), '{"x": 1}', TEXT, "ok"]
    pieces, _ = run(chars("<tool_call>not json</tool_call>", 3))
    assert squash(pieces) == ["<tool_call>not json</tool_call>"]
    pieces, _ = run(["<tool_call>\n{\"name\": \"f\""])  # cut before its arguments: the text it was
    assert squash(pieces) == ['<tool_call>\n{"name": "f"']


def test_a_token_that_ends_a_call_and_starts_text_counts_once() -> None:
    syntax = ToolCallSyntax()
    syntax.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1')
    pieces = syntax.feed("}}\n</tool_call>Done")
    assert pieces == ["}", TEXT, Extra("Done")]


def test_a_continuation_primed_with_the_answer_so_far_goes_on_where_it_stopped() -> None:
    written = replay_text("Hi ", [("a", '{"x": 1}', True), ("b", '{"y": [1, ', False)])
    assert written == "Hi " + closed_call_text("a", '{"x": 1}') + call_text("b", '{"y": [1, ')
    syntax = ToolCallSyntax()
    syntax.prime(written)
    pieces = syntax.feed("2]}}\n</tool_call>")
    assert squash(pieces + syntax.end()) == ["2]}"] and syntax.calls == 2
    args = '{"y": [1, ' + "2]}"
    assert json.loads(args) == {"y": [1, 2]}
