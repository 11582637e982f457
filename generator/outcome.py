"""How a generation ended, as what its worker writes: a pure function of the run's ``Ending`` (generator.lease) and
of how the answer itself ended (``AnswerEnd``). generator.generation only carries it out.

The order, first that holds: fenced out (another worker owns the stream: nothing is written), handed over (the next
owner ends it: the job goes back to the queue), a bug of rsb's (error ``internal``), a cancel (``cancelled``, unless
the answer was already complete: then ``done``), the deadline (error ``deadline``), a call of a tool the request did
not offer (error ``undeclared_tool``), the engine's error (its code), else ``done`` with its finish reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.errors import RsbError
from broker.events import FinishReason
from generator.engines import error_code
from generator.lease import Ending

#: The ``error`` code of a generation ended by a bug of rsb's own (not the engine's): broker.errors' base code.
INTERNAL = RsbError.code


@dataclass(frozen=True, slots=True)
class AnswerEnd:
    """How the answer's own tokens ended, as the attempt saw them (generator.answer)."""

    stopped: bool = False  # a stop sequence ended it (or a call past max_tool_calls: capped); complete
    stop_sequence: str | None = None  # the one that did
    capped: bool = False  # a call past max_tool_calls: the answer ends with the calls before it
    undeclared: str | None = None  # a call of a tool the request did not offer began (its name)
    error: BaseException | None = None  # the engine's
    finish_reason: str | None = None  # the engine's


@dataclass(frozen=True, slots=True)
class FencedOut:
    """Another worker owns the stream: write nothing."""


@dataclass(frozen=True, slots=True)
class HandOver:
    """Give the job back to the queue: its next owner continues it and writes its end."""


@dataclass(frozen=True, slots=True)
class Cancelled:
    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    code: str
    message: str
    engine: bool = False  # the engine's error (logged: a bug of rsb's is logged where it was met)


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: str
    stop_sequence: str | None = None  # which one stopped it (Anthropic's stop_sequence)


Outcome = FencedOut | HandOver | Cancelled | Failed | Done


def describe(error: BaseException) -> str:
    """An ``error`` event's message for a bug: the exception's type and message (a Redis error names a command
    or a script, never a prompt)."""
    return f"{type(error).__name__}: {error}"


def decide_outcome(ending: Ending | None, answer: AnswerEnd, *, failure: BaseException | None = None,
                   cancel_reason: str = "", deadline_s: float = 0.0) -> Outcome:
    """What to write for a run that reached ``ending`` (None: its answer ended by itself), whose answer ended as
    ``answer``. ``failure``: the bug that came with FAILED; ``cancel_reason``: CANCELLED's; ``deadline_s``: the
    bound DEADLINE passed (--max-generation-s)."""
    if ending is Ending.FENCED_OUT:
        return FencedOut()
    if ending is Ending.HANDED_OVER:
        return HandOver()
    if ending is Ending.FAILED and failure is not None:
        return Failed(INTERNAL, describe(failure))
    if ending is Ending.CANCELLED and not answer.stopped:  # an answer complete before the cancel: done
        return Cancelled(cancel_reason)
    if ending is Ending.DEADLINE:
        return Failed("deadline", f"generation exceeded {deadline_s:g} s")
    if answer.undeclared is not None:
        return Failed("undeclared_tool", f"the model called {answer.undeclared[:64]!r}, a tool the request did not "
                      "offer")
    if answer.error is not None:
        return Failed(error_code(answer.error), str(answer.error) or type(answer.error).__name__, engine=True)
    if answer.capped:
        return Done(FinishReason.TOOL_CALLS)
    if answer.stopped:
        return Done(FinishReason.STOP, answer.stop_sequence)
    return Done(answer.finish_reason or FinishReason.STOP, answer.stop_sequence)
