"""rsb/_partial_json.py: for every prefix of a valid JSON document, in every split into pieces, the partial
value is exactly what tests/json_prefixes.py says (so it agrees with the final value), and the whole document
gives json.loads's value; invalid JSON is an error at the character that makes it so."""

from __future__ import annotations

import copy
import itertools
import json
import random
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from json_prefixes import ABSENT, json_values, same, write
from json_prefixes import cuts as piece_cuts

from rsb._partial_json import PartialJSON


def _shown(p: PartialJSON) -> Any:
    return copy.deepcopy(p.value) if p.started else ABSENT


@pytest.mark.slow  # 200 documents, every prefix of each: seconds
@settings(max_examples=200, deadline=None)
@given(json_values, st.randoms(use_true_random=False))
def test_every_prefix_shows_what_the_document_holds_so_far(value: Any, rng: random.Random) -> None:
    doc = write(value, rng)
    # One character at a time: every prefix.
    p = PartialJSON()
    for n, ch in enumerate(doc.text, 1):
        p.feed(ch)
        want = doc.expected(n)
        got = _shown(p)
        assert (got is ABSENT) == (want is ABSENT) and (want is ABSENT or same(got, want)), (doc.text[:n], got, want)
    p.end()
    assert p.done and same(p.value, json.loads(doc.text))
    # In pieces of 1-12 characters, as deltas come: the same value after each piece.
    p = PartialJSON()
    points = piece_cuts(len(doc.text), rng)
    for a, b in itertools.pairwise(points):
        p.feed(doc.text[a:b])
        want = doc.expected(b)
        got = _shown(p)
        assert (got is ABSENT) == (want is ABSENT) and (want is ABSENT or same(got, want)), (doc.text[:b], got, want)
    p.end()
    assert p.done and same(p.value, json.loads(doc.text))


def test_containers_appear_as_they_open_and_strings_grow() -> None:
    p = PartialJSON()
    seen = []
    for piece in ['{"items": [', '{"name": "Ad', 'a Lovel', 'ace", "born": 18', '15', ', "tags": ["ma', 'th"]}', ']}']:
        p.feed(piece)
        seen.append(copy.deepcopy(p.value))
    assert seen == [
        {"items": []},
        {"items": [{"name": "Ad"}]},
        {"items": [{"name": "Ada Lovel"}]},
        {"items": [{"name": "Ada Lovelace"}]},  # 1815 may still grow: not shown yet
        {"items": [{"name": "Ada Lovelace"}]},
        {"items": [{"name": "Ada Lovelace", "born": 1815, "tags": ["ma"]}]},
        {"items": [{"name": "Ada Lovelace", "born": 1815, "tags": ["math"]}]},
        {"items": [{"name": "Ada Lovelace", "born": 1815, "tags": ["math"]}]},
    ]
    assert p.done


def test_escapes_split_anywhere_decode_once_complete() -> None:
    text = '"a\\u00e9\\ud83d\\ude00\\n\\"b"'
    p = PartialJSON()
    shown = []
    for ch in text:
        p.feed(ch)
        shown.append(p.value)
    assert shown[-1] == json.loads(text) == 'aé😀\n"b'
    # Never half an escape, never the lone high half of the pair.
    assert all(json.loads(text).startswith(s) for s in shown[1:])
    assert "\ud83d" not in "".join(s for s in shown[1:] if s is not None)


def test_a_top_level_number_is_complete_at_the_end() -> None:
    p = PartialJSON()
    p.feed("12")
    assert not p.started
    p.feed("3")
    p.end()
    assert p.done and p.value == 123


@pytest.mark.parametrize(("text", "at"), [
    ('{"a": 01}', 6), ("[1, 2,, 3]", 6), ('{"a" 1}', 5), ("[tru]", 1), ('"a\x01"', 2), ('"\\x"', 1),
    ('"\\u12g4"', 1), ("[1.]", 1), ("[-]", 1), ("{} x", 3), ("[1 2]", 3), ('{"a": 1]', 7), ("NaN", 0),
])
def test_invalid_json_is_an_error_where_it_becomes_invalid(text: str, at: int) -> None:
    p = PartialJSON()
    with pytest.raises(ValueError, match=f"at character {at}:"):
        for ch in text:
            p.feed(ch)
        p.end()
    with pytest.raises(ValueError):
        p.feed(" ")  # and it stays broken
    with pytest.raises(ValueError):
        orjson.loads(text)  # (a strict parser agrees; json.loads would take NaN)
