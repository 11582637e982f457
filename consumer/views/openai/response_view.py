"""A response's Responses events and its Response object, folded from its rsb stream's events.

The fold is a pure function of the stream's events read from the first one, so every read makes the same
events with the same ``sequence_number`` s: resuming after N (``starting_after``) replays the stream from its
start and sends what comes after N, in the middle of a call's arguments as anywhere else.

rsb event      Responses events
(before all)   response.created
first queued   response.queued
started        response.in_progress
reasoning      (a reasoning item opens: response.output_item.added, response.content_part.added with a
               ``reasoning_text`` part) response.reasoning_text.delta
delta          (a message item opens: response.output_item.added, response.content_part.added with an
               ``output_text`` part) response.output_text.delta
tool_call      (a function_call item opens, ``call_id`` = the call's id) response.output_item.added
tool_args      response.function_call_arguments.delta
terminal       the open item closes, then response.completed (done: stop or tool_calls),
               response.incomplete (done, length: max_output_tokens; or cancelled: status "cancelled"),
               response.failed (error)

An item is open until another one opens or the stream ends; it closes with its ``.done`` events (reasoning:
response.reasoning_text.done, response.content_part.done; message: response.output_text.done,
response.content_part.done; function call: response.function_call_arguments.done) and
response.output_item.done. rsb's reasoning is the model's own text, not a summary: it is a reasoning item's
``content`` (``reasoning_text``, as open-weight models' servers send it), its ``summary`` stays empty.

OpenAI's stream has no event for a cancelled response; ``response.incomplete`` is the terminal event that
clients already handle for "ended before its end", and its response says ``cancelled``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from broker.events import Event, EventType, parse_event_id
from broker.request.generation import GenerationRequest
from broker.request.tiers import DEFAULT as DEFAULT_TIER
from broker.streams.records import StreamStatus
from consumer.streaming.conversations import openai_id
from consumer.views.openai.common import cached_tokens, usage_tokens
from consumer.views.openai.item_ids import FUNCTION_CALL, MESSAGE, REASONING, ItemId
from consumer.views.openai.shapes import responses_tool_choice, responses_tools, text_config

# The content part of the items that have one.
_PART = {MESSAGE: "output_text", REASONING: "reasoning_text"}


def response_id(stream_id: uuid.UUID) -> str:
    return f"resp_{stream_id.hex}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    prompt, completion = usage_tokens(usage)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached_tokens(usage), "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


@dataclass(slots=True)
class _Item:
    """One output item: a message, a reasoning item or a function call, at ``index`` in the output."""

    kind: str
    id: str
    index: int
    pieces: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # of a message's tokens (logprobs events)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def part(self) -> dict[str, Any]:
        if self.kind == MESSAGE:
            return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}
        return {"type": "reasoning_text", "text": self.text}

    def json(self, *, opening: bool = False) -> dict[str, Any]:
        """The item as the Response shows it; ``opening``: as response.output_item.added shows it (before
        its content part is added)."""
        if self.kind == FUNCTION_CALL:
            return {"id": self.id, "type": FUNCTION_CALL, "call_id": self.call_id, "name": self.name,
                    "arguments": self.text, "status": self.status}
        content = [] if opening else [self.part()]
        if self.kind == MESSAGE:
            return {"id": self.id, "type": MESSAGE, "role": "assistant", "status": self.status, "content": content}
        return {"id": self.id, "type": REASONING, "summary": [], "content": content, "status": self.status}


class ResponseView:
    """Folds one stream's events, in order from the first, into Responses events and the Response object
    (the module's docstring has the mapping)."""

    def __init__(self, stream_id: uuid.UUID, st: StreamStatus, req: GenerationRequest | None) -> None:
        self.id = response_id(stream_id)
        self.stream_id = stream_id
        # Only what never changes goes into the objects, so every read folds to the same events: the request as
        # stored, and the model that runs it (its queue's, resolved at create: the worker's name is the same).
        self.created_at = int(st.created_at)
        self.model = st.model
        self.service_tier = st.tier or DEFAULT_TIER
        self.temperature = req.temperature if req is not None else None
        self.top_p = req.top_p if req is not None else None
        self.tools = responses_tools(req)
        self.tool_choice = responses_tool_choice(req)
        self.text_config = text_config(req)
        self.max_output_tokens = st.max_tokens
        history = req.history if req is not None else None
        # What the request set only to see it back (broker.request.echo), and its instructions: the leading system
        # message its history counts apart (never carried into a later response).
        lead = req.messages[0] if req is not None and req.messages and history is not None and history.lead else None
        self.instructions = lead.content if lead is not None and lead.role == "system" else None
        self.echo: dict[str, Any] = {
            "metadata": req.echoed("metadata", {}) if req is not None else {},
            "store": req.echoed("store", True) if req is not None else True,
            "user": req.echoed("user") if req is not None else None,
            "safety_identifier": req.echoed("safety_identifier") if req is not None else None,
            "parallel_tool_calls": req.sampling.parallel_tool_calls if req is not None else True,
            "max_tool_calls": req.sampling.max_tool_calls if req is not None else None,
            "top_logprobs": req.sampling.top_logprobs if req is not None and req.sampling.logprobs else None}
        self.conversation = None if history is None or history.conversation is None else {
            "id": openai_id(history.conversation)}
        self.previous = None if history is None or history.previous is None else response_id(
            uuid.UUID(history.previous))
        self.seq = 0
        self.status = "queued"
        self.queued = False
        self.started = False
        self.ended = False
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # tool call index -> its item
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.completed_at: int | None = None

    @property
    def text(self) -> str:
        """The answer's text (every message item's)."""
        return "".join(item.text for item in self.items if item.kind == MESSAGE)

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": type_, **fields, "sequence_number": self.seq}
        self.seq += 1
        return ev

    def response(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            # Every rsb generation runs detached from its connections: background, whatever was asked.
            "background": True, "completed_at": self.completed_at, "error": self.error,
            "incomplete_details": self.incomplete, "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens, "model": self.model, "service_tier": self.service_tier,
            "output": [item.json() for item in self.items], **self.echo,
            "previous_response_id": self.previous, "conversation": self.conversation,
            "temperature": self.temperature, "top_p": self.top_p,
            "text": self.text_config, "tool_choice": self.tool_choice, "tools": self.tools,
            "truncation": "disabled", "usage": _usage(self.usage),
        }

    def opening(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response())]

    def _start(self) -> list[dict[str, Any]]:
        self.started = True
        self.status = "in_progress"
        return [self._event("response.in_progress", response=self.response())]

    # -- items ---------------------------------------------------------------------------------------

    def _open(self, kind: str, out: list[dict[str, Any]], **fields: Any) -> _Item:
        self._close("completed", out)
        index = len(self.items)
        item = _Item(kind, str(ItemId.of_output(kind, self.stream_id, index)), index, **fields)
        self.items.append(item)
        self.open = item
        out.append(self._event("response.output_item.added", output_index=index, item=item.json(opening=True)))
        if kind in _PART:
            out.append(self._event("response.content_part.added", item_id=item.id, output_index=index,
                                   content_index=0, part=item.part()))
        return item

    def _close(self, status: str, out: list[dict[str, Any]]) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        item.status = status
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == FUNCTION_CALL:
            out.append(self._event("response.function_call_arguments.done", **where, name=item.name,
                                   arguments=item.text))
        else:
            done = "response.output_text.done" if item.kind == MESSAGE else "response.reasoning_text.done"
            extra: dict[str, Any] = {"logprobs": item.logprobs} if item.kind == MESSAGE else {}
            out.append(self._event(done, **where, content_index=0, text=item.text, **extra))
            out.append(self._event("response.content_part.done", **where, content_index=0, part=item.part()))
        out.append(self._event("response.output_item.done", output_index=item.index, item=item.json()))

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out = [] if self.started else self._start()
        item = self.open if self.open is not None and self.open.kind == kind else self._open(kind, out)
        item.pieces.append(text)
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0, "delta": text}
        if kind == MESSAGE:
            out.append(self._event("response.output_text.delta", **where, logprobs=[]))
        else:
            out.append(self._event("response.reasoning_text.delta", **where))
        return out

    def _tool_call(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        out = [] if self.started else self._start()
        self.calls[data["index"]] = self._open(FUNCTION_CALL, out, call_id=data["id"], name=data["name"])
        return out

    def _tool_args(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        item = self.calls.get(data["index"])
        if item is None:
            return []  # arguments of a call never begun: no engine sends that
        item.pieces.append(data["text"])
        return [self._event("response.function_call_arguments.delta", item_id=item.id, output_index=item.index,
                            delta=data["text"])]

    # -- the fold ------------------------------------------------------------------------------------

    def feed(self, ev: Event) -> list[dict[str, Any]]:
        if self.ended:
            return []
        if ev.type == EventType.QUEUED:
            if self.queued or self.started:
                return []  # later positions in the queue: the Response object has no field for them
            self.queued = True
            return [self._event("response.queued", response=self.response())]
        if ev.type == EventType.STARTED:
            return [] if self.started else self._start()
        if ev.type == EventType.DELTA:
            return self._text(MESSAGE, ev.json()["text"])
        if ev.type == EventType.REASONING:
            return self._text(REASONING, ev.json()["text"])
        if ev.type == EventType.TOOL_CALL:
            return self._tool_call(ev.json())
        if ev.type == EventType.TOOL_ARGS:
            return self._tool_args(ev.json())
        if ev.type == EventType.LOGPROBS:
            # The tokens of the text just sent: part of the message item (its output_text.done and its part);
            # the deltas already went out with none.
            if self.open is not None and self.open.kind == MESSAGE:
                self.open.logprobs.extend(ev.json()["content"])
            return []
        if not ev.is_terminal:
            return []  # an event type this view does not know: nothing to say about it
        return self._end(ev)

    def _end(self, ev: Event) -> list[dict[str, Any]]:
        data = ev.json()
        self.usage = data.get("usage")
        key = parse_event_id(ev.id)  # the server's clock when the stream ended (ids are Redis times)
        self.completed_at = key[0] // 1000 if key is not None else None
        if ev.type == EventType.DONE and data.get("finish_reason") != "length":
            self.status, final = "completed", "response.completed"
        elif ev.type == EventType.DONE:
            self.status, final = "incomplete", "response.incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
        elif ev.type == EventType.CANCELLED:
            self.status, final = "cancelled", "response.incomplete"
        else:
            self.status, final = "failed", "response.failed"
            # ResponseError.code is a closed list; rsb's code (deadline, worker_lost, engine) goes in the text.
            self.error = {"code": "server_error",
                          "message": f"{data.get('code', 'engine')}: {data.get('message', 'generation failed')}"}
        self.ended = True
        out: list[dict[str, Any]] = []
        self._close("completed" if self.status == "completed" else "incomplete", out)
        out.append(self._event(final, response=self.response()))
        return out
