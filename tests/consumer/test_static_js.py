"""The page's ES modules under Node 20 (no browser, nothing to install): consumer/static/partial-json.js holds
the same property as rsb/_partial_json.py (for every prefix of a valid JSON document, in any split into
pieces, the partial value is what tests/json_prefixes.py says), and rsb-client.js's ``Answer`` keeps text,
reasoning and tool calls apart, applies ``reset`` to all of them, and survives its own ``toJSON()`` (what the
page stores in localStorage)."""

from __future__ import annotations

import itertools
import json
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from json_prefixes import ABSENT, json_values, same, write
from json_prefixes import cuts as piece_cuts

HARNESS = Path(__file__).resolve().parent / "static" / "harness.mjs"
NODE = shutil.which("node")
pytestmark = [pytest.mark.slow,  # one node process for the module
              pytest.mark.skipif(NODE is None, reason="node is not installed (Node 20: apt-get install nodejs)")]


class Node:
    """One `node harness.mjs` for the module: a request per line, its answer per line."""

    def __init__(self) -> None:
        assert NODE is not None
        self.proc = subprocess.Popen([NODE, str(HARNESS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, encoding="utf-8")

    def ask(self, **req: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"node exited ({self.proc.poll()})"
        out = json.loads(line)
        assert "crash" not in out, out["crash"]
        return out

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node()
    yield n
    n.close()


def _check(shown: list[Any], want: Any) -> None:
    started, value = shown
    assert started == (want is not ABSENT), (shown, want)
    if started:
        # JavaScript has one number type and orders integer-like keys first: compare values, not spellings.
        assert same(value, want, numbers=True, ordered=False), (value, want)


@settings(max_examples=200, deadline=None)
@given(json_values, st.randoms(use_true_random=False))
def test_every_prefix_shows_what_the_document_holds_so_far(node: Node, value: Any, rng: random.Random) -> None:
    doc = write(value, rng)
    points = piece_cuts(len(doc.text), rng)
    for pieces, ends in [(list(doc.text), range(1, len(doc.text) + 1)),
                         ([doc.text[a:b] for a, b in itertools.pairwise(points)], points[1:])]:
        out = node.ask(op="pieces", pieces=pieces)
        assert "error" not in out, (doc.text, out["error"])
        for shown, n in zip(out["after"], ends, strict=True):
            _check(shown, doc.expected(n))
        assert out["done"]
        _check(out["final"], json.loads(doc.text))


@pytest.mark.parametrize(("text", "at"), [
    ('{"a": 01}', 6), ("[1, 2,, 3]", 6), ('{"a" 1}', 5), ("[tru]", 1), ('"a\x01"', 2), ('"\\x"', 1),
    ('"\\u12g4"', 1), ("[1.]", 1), ("[-]", 1), ("{} x", 3), ("[1 2]", 3), ('{"a": 1]', 7), ("NaN", 0),
])
def test_invalid_json_is_an_error_where_it_becomes_invalid(node: Node, text: str, at: int) -> None:
    out = node.ask(op="pieces", pieces=list(text))
    assert out["error"].startswith(f"invalid JSON at character {at}:")


def test_a_proto_key_is_a_member_not_a_prototype(node: Node) -> None:
    out = node.ask(op="pieces", pieces=['{"__proto__": {"polluted": true}, "a": 1}'])
    assert out["final"] == [True, {"__proto__": {"polluted": True}, "a": 1}]


def test_the_answer_keeps_typed_output_apart_applies_resets_and_survives_its_own_json(node: Node) -> None:
    args = '{"city": "Z\\u00fcrich", "days": [1, 2]}'
    events = [
        ["1-0", "started", {"model": "m"}], ["2-0", "reasoning", {"text": "Let me "}],
        ["3-0", "delta", {"text": "Checking."}], ["4-0", "tool_call", {"index": 0, "id": "call_a", "name": "weather"}],
        ["5-0", "tool_args", {"index": 0, "text": args[:14]}], ["6-0", "reasoning", {"text": "think."}],
        ["7-0", "tool_args", {"index": 0, "text": args[14:36]}], ["8-0", "tool_call", {"index": 1, "id": "b", "name": "t"}],
        # A failover lost 6-0 and after: the reasoning's end, the arguments' middle, the second call.
        ["5-0", "reset", {"last_event_id": "5-0"}],
        ["9-0", "tool_args", {"index": 0, "text": args[14:]}], ["10-0", "reasoning", {"text": "see."}],
        ["11-0", "delta", {"text": " Done."}], ["12-0", "done", {"finish_reason": "tool_calls", "usage": {}}],
    ]
    out = node.ask(op="answer", events=events)
    after = out["after"]
    assert [a["changed"] for a in after] == [False] + [True] * 10 + [True, False]
    before_reset, at_reset, end = after[7], after[8], after[-1]
    assert before_reset["reasoning"] == "Let me think." and len(before_reset["toolCalls"]) == 2
    assert before_reset["toolCalls"][0]["parsedArguments"] == [True, {"city": "Zürich", "days": [1]}]
    assert at_reset["reasoning"] == "Let me " and at_reset["text"] == "Checking." and at_reset["deltas"] == 1
    assert [(c["index"], c["name"], c["arguments"]) for c in at_reset["toolCalls"]] == [(0, "weather", args[:14])]
    assert at_reset["toolCalls"][0]["parsedArguments"] == [True, {"city": "Z"}]
    assert end["text"] == "Checking. Done." and end["reasoning"] == "Let me see." and end["deltas"] == 2
    assert end["toolCalls"] == [{"index": 0, "id": "call_a", "name": "weather", "arguments": args,
                                 "parsedArguments": [True, {"city": "Zürich", "days": [1, 2]}]}]
    assert end["parsed"] == {"error": "invalid JSON at character 0: unexpected \"C\" where a value should be"}
    # What the page stores and reads back after a reload: the same answer (the terminal event is not part of it).
    restored = out["restored"]
    assert {k: restored[k] for k in ("text", "reasoning", "deltas")} == {k: end[k] for k in ("text", "reasoning", "deltas")}
    assert [c["arguments"] for c in restored["toolCalls"]] == [args]
    # And a reset to the start takes back everything.
    wiped = node.ask(op="answer", events=[*events[:8], ["0-0", "reset", {"last_event_id": None}]])["after"][-1]
    assert (wiped["text"], wiped["reasoning"], wiped["toolCalls"], wiped["deltas"]) == ("", "", [], 0)


def test_a_snapshot_replaces_the_answer_and_what_follows_continues_it(node: Node) -> None:
    """A read from the latest (?from=latest): the snapshot is the answer so far, the tail adds to it, as a full
    read would have it; a second snapshot (where a reset would come) replaces it all again."""
    args = '{"city": "Z\u00fcrich"}'
    snapshot = {"text": "Checking.", "reasoning": "Let me think.", "last_event_id": "7-0",
                "tool_calls": [{"index": 0, "id": "call_a", "name": "weather", "arguments": args[:9]}]}
    events = [["1-0", "delta", {"text": "stale"}], ["7-0", "snapshot", snapshot],
              ["8-0", "tool_args", {"index": 0, "text": args[9:]}], ["9-0", "delta", {"text": " Done."}],
              ["9-0", "snapshot", {"text": "Again", "reasoning": "", "tool_calls": [], "last_event_id": "9-0"}]]
    after = node.ask(op="answer", events=events)["after"]
    joined = after[3]
    assert (joined["text"], joined["reasoning"]) == ("Checking. Done.", "Let me think.")
    assert joined["toolCalls"] == [{"index": 0, "id": "call_a", "name": "weather", "arguments": args,
                                    "parsedArguments": [True, {"city": "Zürich"}]}]
    assert (after[4]["text"], after[4]["reasoning"], after[4]["toolCalls"]) == ("Again", "", [])


def test_a_structured_answer_is_parsed_as_it_comes(node: Node) -> None:
    doc = json.dumps({"title": "Redis", "uses": ["cache", "queue"], "stars": 4.5})
    events = [[f"{i + 1}-0", "delta", {"text": doc[i:i + 7]}] for i in range(0, len(doc), 7)]
    events.append(["99-0", "done", {"finish_reason": "stop", "usage": {}}])
    after = node.ask(op="answer", events=events)["after"]
    assert [a["parsed"] for a in after[:4]] == [[True, {}], [True, {"title": "Red"}], [True, {"title": "Redis"}],
                                                [True, {"title": "Redis", "uses": []}]]
    assert after[-1]["parsed"] == [True, json.loads(doc)]
