"""The answer as events, both ways: a generation's pieces become events (each run of one kind one event:
``delta``, ``reasoning``, ``tool_call`` + ``tool_args``), and stored events become the answer so far, for a
generation continued after a crash.

Stop sequences apply to the answer's text only (never to reasoning or a call's arguments); text held back
because it may begin a stop sequence is let go when the text stops (the next piece is of another kind), so a
stop sequence never spans kinds. A batch of plain text (no marker, the answer's text) costs what it always
did: one join and one stop-filter feed.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson

from broker.events import EventType, delta, logprobs, reasoning, tool_args, tool_call
from generator.engines.pieces import (
    REASONING,
    TEXT,
    Channel,
    PartialAnswer,
    PartialCall,
    Piece,
    TokenLogprob,
    ToolCallStart,
)
from generator.stops import StopFilter

Events = list[tuple[str, bytes]]


class AnswerEvents:
    """Turns batches of pieces into the events to append. ``kind`` is what the next bare text piece is:
    ``TEXT``, ``REASONING`` or the index of the call whose arguments it continues."""

    def __init__(self, stops: tuple[str, ...], partial: PartialAnswer, max_calls: int | None = None,
                 offered: frozenset[str] | None = None) -> None:
        self._stops = StopFilter(stops)
        self.kind: Channel | int = partial.ends_in
        self._max_calls = max_calls
        self._offered = offered
        #: The name of a tool the request did not offer that the model began to call: never presented as a
        #: call, the answer ends there (the generation with an ``undeclared_tool`` error).
        self.undeclared: str | None = None
        #: The answer began a call past ``max_calls`` (``max_tool_calls``, ``parallel_tool_calls: false``): it
        #: ends before that call, as an answer that made its calls.
        self.capped = False

    @property
    def stop_sequence(self) -> str | None:
        """The stop sequence that ended the answer's text, if one did."""
        return self._stops.matched

    @property
    def stopped(self) -> bool:
        """A stop sequence appeared in the text, or a call past the bound began (neither is emitted, nor
        anything after it)."""
        return self._stops.stopped or self.capped or self.undeclared is not None

    def feed(self, pieces: list[Piece], markers: int) -> Events:
        if not markers and self.kind is TEXT:
            text = self._stops.feed("".join(pieces))  # type: ignore[arg-type]  # no marker: all str
            return [delta(text)] if text else []
        events: Events = []
        run: list[str] = []
        probs: list[dict[str, object]] = []  # of this batch's text tokens: one logprobs event after their text
        for piece in pieces:
            if isinstance(piece, str):  # a token's text, or an Extra
                run.append(piece)
                continue
            if isinstance(piece, TokenLogprob):
                if self.kind is TEXT and not self.stopped:
                    probs.append(piece.as_json())
                continue
            self._close(run, events)
            run = []
            if self.stopped:
                return events
            if self.kind is TEXT:
                held = self._stops.flush()
                if held:
                    events.append(delta(held))
            if isinstance(piece, ToolCallStart):
                if self._offered is not None and piece.name not in self._offered:
                    self.undeclared = piece.name
                    return events
                if self._max_calls is not None and piece.index >= self._max_calls:
                    self.capped = True
                    return events
                events.append(tool_call(piece.index, piece.id, piece.name))
                self.kind = piece.index
            else:
                assert isinstance(piece, Channel)
                self.kind = piece
        self._close(run, events)
        if probs:
            events.append(logprobs(probs))
        return events

    def _close(self, run: list[str], events: Events) -> None:
        if not run or self.stopped:
            return
        text = "".join(run)
        kind = self.kind
        if kind is TEXT:
            text = self._stops.feed(text)
            if text:
                events.append(delta(text))
        elif not text:
            return
        elif kind is REASONING:
            events.append(reasoning(text))
        else:
            assert isinstance(kind, int)
            events.append(tool_args(kind, text))

    def flush(self) -> Events:
        """At the end of a generation that was not stopped: the text held back for the stop sequences."""
        held = self._stops.flush()
        return [delta(held)] if held else []


class AnswerSoFar:
    """The answer an earlier attempt appended, rebuilt from its events (``add`` each, in order)."""

    def __init__(self) -> None:
        self.started = False
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, tuple[str, str, list[str]]] = {}
        self._ends_in: Channel | int = TEXT

    def add(self, etype: str, data: bytes) -> None:
        if etype == EventType.DELTA:
            self._text.append(orjson.loads(data)["text"])
            self._ends_in = TEXT
        elif etype == EventType.REASONING:
            self._reasoning.append(orjson.loads(data)["text"])
            self._ends_in = REASONING
        elif etype == EventType.TOOL_CALL:
            d = orjson.loads(data)
            self._calls[d["index"]] = (d["id"], d["name"], [])
            self._ends_in = d["index"]
        elif etype == EventType.TOOL_ARGS:
            d = orjson.loads(data)
            self._calls[d["index"]][2].append(d["text"])
            self._ends_in = d["index"]
        elif etype == EventType.STARTED:
            self.started = True

    def add_all(self, events: Iterable[tuple[str, bytes]]) -> None:
        for etype, data in events:
            self.add(etype, data)

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def partial(self) -> PartialAnswer:
        calls = tuple(PartialCall(i, cid, name, "".join(args)) for i, (cid, name, args) in sorted(self._calls.items()))
        return PartialAnswer("".join(self._reasoning), calls, self._ends_in)
