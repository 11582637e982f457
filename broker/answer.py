"""The answer a stream's events add up to, event by event, kept as its runs: each run of one kind (the text, the
reasoning, a call's start, a call's arguments) one run, however many events it took. From the runs come the
answer's parts (``text``, ``reasoning``, ``tool_calls``) and the same answer as the fewest events that make it
(``events``: one per run), which a view turns into its protocol's frames exactly as it would the events
themselves. A late joiner's snapshot (consumer.streaming.snapshots) and a finished turn's output
(broker.streams.turns) are both read this way: one pure function of the events, added up once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from broker.events import Event, EventType, encode_data

#: The event types whose texts a run joins (consecutive events of one of these types, and of one call, merge).
_JOINED = frozenset({EventType.DELTA, EventType.REASONING, EventType.TOOL_ARGS})


@dataclass(frozen=True, slots=True)
class CallSoFar:
    """A tool call as its events stand: ``arguments`` is the JSON text received so far (partial while it streams)."""

    index: int
    id: str
    name: str
    arguments: str

    def as_json(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "name": self.name, "arguments": self.arguments}


class _Run:
    __slots__ = ("head", "index", "last_id", "pieces", "type")

    def __init__(self, etype: str, index: int, last_id: str, head: dict[str, Any] | None, text: str) -> None:
        self.type, self.index, self.last_id, self.head = etype, index, last_id, head
        self.pieces = [text] if text else []

    def text(self) -> str:
        """The run's text; its pieces are joined once, then kept joined (a run read again costs one piece)."""
        if len(self.pieces) > 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""


class AnswerRuns:
    """Add a stream's events in order (``add``); read the answer so far at any point. Terminal events are not
    part of the answer (a caller stops before them); ``queued``, ``progress`` and ``logprobs`` events say
    nothing about its content and are left out; the last ``started`` event is kept (it names the model)."""

    __slots__ = ("_runs", "last_id", "started")

    def __init__(self) -> None:
        self._runs: list[_Run] = []
        #: The id of the last event added (None: none yet).
        self.last_id: str | None = None
        self.started: Event | None = None

    def add(self, ev: Event) -> None:
        self.last_id = ev.id
        etype = ev.type
        if etype == EventType.STARTED:
            self.started = ev
            return
        if etype not in _JOINED and etype != EventType.TOOL_CALL:
            return
        data = ev.json()
        index = int(data.get("index") or 0)
        last = self._runs[-1] if self._runs else None
        if etype in _JOINED and last is not None and last.type == etype and last.index == index:
            last.pieces.append(str(data.get("text") or ""))
            last.last_id = ev.id
            return
        if etype == EventType.TOOL_CALL:
            self._runs.append(_Run(etype, index, ev.id, data, ""))
        else:
            self._runs.append(_Run(etype, index, ev.id, None, str(data.get("text") or "")))

    def add_all(self, events: Iterable[Event]) -> None:
        for ev in events:
            self.add(ev)

    def _joined(self, etype: str) -> str:
        return "".join([r.text() for r in self._runs if r.type == etype])

    @property
    def text(self) -> str:
        return self._joined(EventType.DELTA)

    @property
    def reasoning(self) -> str:
        return self._joined(EventType.REASONING)

    @property
    def tool_calls(self) -> list[CallSoFar]:
        """The calls by index: id and name from their ``tool_call``, arguments the ``tool_args`` so far."""
        calls: dict[int, list[Any]] = {}
        for r in self._runs:
            if r.type == EventType.TOOL_CALL:
                head = r.head or {}
                calls[r.index] = [str(head.get("id") or ""), str(head.get("name") or ""), []]
            elif r.type == EventType.TOOL_ARGS:
                calls.setdefault(r.index, ["", "", []])[2].append(r.text())
        return [CallSoFar(i, c[0], c[1], "".join(c[2])) for i, c in sorted(calls.items())]

    def events(self) -> list[Event]:
        """The answer as the fewest events that make it: ``started`` (if any), then one event per run, each with
        the id of the last event it stands for. A view's frames of these are its frames of the events
        themselves, each run's texts sent as one piece."""
        out = [self.started] if self.started is not None else []
        for r in self._runs:
            if r.type == EventType.TOOL_CALL:
                out.append(Event(r.last_id, r.type, orjson.dumps(r.head)))
            else:
                data: dict[str, Any] = {"text": r.text()}
                if r.type == EventType.TOOL_ARGS:
                    data = {"index": r.index, **data}
                out.append(Event(r.last_id, r.type, encode_data(data)))
        return out

    def snapshot_data(self) -> dict[str, Any]:
        """The ``snapshot`` event's data (the native view's late joiners: docs/protocol.md)."""
        return {"text": self.text, "reasoning": self.reasoning,
                "tool_calls": [c.as_json() for c in self.tool_calls], "last_event_id": self.last_id}
