"""How a generation ended (generator.outcome.decide_outcome), one row per case: the run's ending and how its answer
ended in, what its worker writes out."""

from __future__ import annotations

import pytest

from broker.events import FinishReason
from generator.engines.base import EngineError
from generator.lease import Ending
from generator.outcome import (
    INTERNAL,
    AnswerEnd,
    Cancelled,
    Done,
    Failed,
    FencedOut,
    HandOver,
    Outcome,
    decide_outcome,
)

BUG = KeyError("seq")
ENGINE = EngineError("the context is full")
COMPLETE = AnswerEnd(stopped=True, stop_sequence="END")

ROWS: list[tuple[str, Ending | None, AnswerEnd, Outcome]] = [
    ("fenced out", Ending.FENCED_OUT, COMPLETE, FencedOut()),
    ("handed over", Ending.HANDED_OVER, AnswerEnd(error=ENGINE), HandOver()),
    ("failed", Ending.FAILED, AnswerEnd(), Failed(INTERNAL, "KeyError: 'seq'")),
    ("cancelled", Ending.CANCELLED, AnswerEnd(finish_reason="length"), Cancelled("client")),
    ("cancelled after a complete answer", Ending.CANCELLED, COMPLETE, Done(FinishReason.STOP, "END")),
    ("deadline", Ending.DEADLINE, AnswerEnd(), Failed("deadline", "generation exceeded 2.5 s")),
    ("undeclared tool", None, AnswerEnd(undeclared="rm_rf", error=ENGINE),
     Failed("undeclared_tool", "the model called 'rm_rf', a tool the request did not offer")),
    ("engine error", None, AnswerEnd(error=ENGINE, finish_reason="stop"),
     Failed(EngineError.code, "the context is full", engine=True)),
    ("capped tool calls", None, AnswerEnd(stopped=True, stop_sequence="END", capped=True, finish_reason="stop"),
     Done(FinishReason.TOOL_CALLS)),
    ("stopped", None, AnswerEnd(stopped=True, finish_reason="length"), Done(FinishReason.STOP)),
    ("stop sequence", None, AnswerEnd(stopped=True, stop_sequence="END"), Done(FinishReason.STOP, "END")),
    ("plain finish", None, AnswerEnd(finish_reason="length"), Done(FinishReason.LENGTH)),
    ("plain finish, no reason", None, AnswerEnd(), Done(FinishReason.STOP)),
    ("the engine's own stop sequence", None, AnswerEnd(stop_sequence="END", finish_reason="stop"),
     Done(FinishReason.STOP, "END")),
]


@pytest.mark.parametrize(("ending", "answer", "outcome"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_the_outcome_of_each_ending(ending: Ending | None, answer: AnswerEnd, outcome: Outcome) -> None:
    assert decide_outcome(ending, answer, failure=BUG if ending is Ending.FAILED else None, cancel_reason="client",
                          deadline_s=2.5) == outcome


def test_an_ending_outranks_how_the_answer_ended() -> None:
    # What the run reached decides before the answer's own end: a cancel before an engine error, a deadline before
    # an undeclared tool; a complete answer is done even when a cancel came after it, but never when fenced out.
    broken = AnswerEnd(undeclared="x", error=ENGINE)
    assert decide_outcome(Ending.CANCELLED, broken, cancel_reason="abandoned") == Cancelled("abandoned")
    assert decide_outcome(Ending.DEADLINE, broken, deadline_s=60) == Failed("deadline", "generation exceeded 60 s")
    assert decide_outcome(Ending.FAILED, COMPLETE, failure=BUG) == Failed(INTERNAL, "KeyError: 'seq'")
    assert decide_outcome(Ending.HANDED_OVER, COMPLETE) == HandOver()
