"""The pump's view of an answer: runs of one kind become one event each (stop sequences on text only), and
stored events become the answer so far for a continuation."""

from __future__ import annotations

import orjson

from broker.events import delta, reasoning, tool_args, tool_call
from generator.answer import AnswerEvents, AnswerSoFar
from generator.engines.pieces import NOTHING, REASONING, TEXT, Extra, PartialAnswer, Piece, ToolCallStart


def feed(answer: AnswerEvents, pieces: list[Piece]) -> list[tuple[str, object]]:
    markers = sum(type(p) is not str for p in pieces)
    return [(t, orjson.loads(d)) for t, d in answer.feed(pieces, markers)]


def test_plain_text_is_one_delta_per_batch() -> None:
    answer = AnswerEvents((), NOTHING)
    assert feed(answer, ["Hel", "lo"]) == [("delta", {"text": "Hello"})]


def test_each_run_of_one_kind_is_one_event_in_order() -> None:
    answer = AnswerEvents((), NOTHING)
    got = feed(answer, [REASONING, "I ", "think", TEXT, "So", Extra("."), ToolCallStart(0, "c1", "f"), '{"a"', ": 1}",
                        ToolCallStart(1, "c2", "g"), "{}", ""])
    assert got == [("reasoning", {"text": "I think"}), ("delta", {"text": "So."}),
                   ("tool_call", {"index": 0, "id": "c1", "name": "f"}), ("tool_args", {"index": 0, "text": '{"a": 1}'}),
                   ("tool_call", {"index": 1, "id": "c2", "name": "g"}), ("tool_args", {"index": 1, "text": "{}"})]
    # The next batch goes on in the kind the last one ended in.
    assert feed(answer, ["x"]) == [("tool_args", {"index": 1, "text": "x"})]


def test_stop_sequences_apply_to_text_only_and_never_span_kinds() -> None:
    answer = AnswerEvents(("END",), NOTHING)
    got = feed(answer, [REASONING, "the END is near", TEXT, "ab", "E"])
    assert got == [("reasoning", {"text": "the END is near"}), ("delta", {"text": "ab"})]  # "E" held back
    got = feed(answer, [ToolCallStart(0, "c", "f"), "END"])
    assert got == [("delta", {"text": "E"}), ("tool_call", {"index": 0, "id": "c", "name": "f"}),
                   ("tool_args", {"index": 0, "text": "END"})]
    assert not answer.stopped
    assert feed(answer, [TEXT, "xEN", "D and more", REASONING, "dropped"]) == [("delta", {"text": "x"})]
    assert answer.stopped


def test_a_continuation_starts_in_the_kind_the_stored_answer_ended_in() -> None:
    answer = AnswerEvents((), PartialAnswer(ends_in=3))
    assert feed(answer, ["9}"]) == [("tool_args", {"index": 3, "text": "9}"})]


def test_the_answer_so_far_is_rebuilt_from_its_events() -> None:
    so_far = AnswerSoFar()
    so_far.add_all([("started", b'{"model":"m"}'), reasoning("Hm"), reasoning("m."), delta("Hi"),
                    tool_call(0, "c1", "f"), tool_args(0, '{"a":'), tool_args(0, " 1}"), tool_call(1, "c2", "g"),
                    tool_args(1, '{"b')])
    assert so_far.started and so_far.text == "Hi"
    partial = so_far.partial
    assert partial.reasoning == "Hmm." and partial.ends_in == 1 and partial.typed
    assert [(c.index, c.id, c.name, c.arguments) for c in partial.calls] == [(0, "c1", "f", '{"a": 1}'),
                                                                          (1, "c2", "g", '{"b')]
    plain = AnswerSoFar()
    plain.add_all([delta("a"), delta("b")])
    assert plain.text == "ab" and not plain.partial.typed and plain.partial.ends_in is TEXT


def test_a_call_past_max_tool_calls_ends_the_answer_before_it() -> None:
    answer = AnswerEvents((), NOTHING, max_calls=1)
    got = feed(answer, [ToolCallStart(0, "c1", "f"), "{}", ToolCallStart(1, "c2", "f"), "{}", TEXT, "more"])
    assert got == [("tool_call", {"index": 0, "id": "c1", "name": "f"}), ("tool_args", {"index": 0, "text": "{}"})]
    assert answer.capped and answer.stopped


def test_a_call_of_a_tool_not_offered_is_never_presented_as_a_call() -> None:
    answer = AnswerEvents((), NOTHING, offered=frozenset({"get_weather"}))
    got = feed(answer, ["Let me check.", ToolCallStart(0, "c1", "rm_rf"), '{"path": "/"}'])
    assert got == [("delta", {"text": "Let me check."})]
    assert answer.undeclared == "rm_rf" and answer.stopped
    assert feed(AnswerEvents((), NOTHING, offered=frozenset()), [ToolCallStart(0, "c", "f")]) == []
