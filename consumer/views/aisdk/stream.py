"""A turn's rsb events as the AI SDK's UI message stream (``x-vercel-ai-ui-message-stream: v1``): one
``data: <chunk JSON>`` frame per chunk, ``data: [DONE]`` after the last.

The chunks are a pure function of the stream's events, always read from the stream's first event: every
read of a turn (the POST that started it, a resume, a second tab) sends the same chunks, beginning with
``start`` and the turn's one message id (its stream id, or the id of the message a turn after tool results
continues). The SDK replaces a message by id, so a replay lands as one copy of the answer, never a second
message; and it refuses a ``text-delta`` (``reasoning-delta``, ``tool-input-delta``) whose start it never saw,
which is why a read never starts mid-turn. The one difference between reads: a resume of a turn that
continues a message first sends that message's earlier steps (``earlier_steps``), which the SDK drops when it
starts a resumed message afresh.

The SDK validates every chunk against a closed union (an unknown ``type`` fails the turn), so rsb-only
events travel as transient ``data-rsb-*`` chunks (they reach ``onData`` only) and everything else as the
SDK's own chunks. Its ``finish`` has no "cancelled" reason: a stop ends with ``abort``, after a
``message-metadata`` chunk saying ``status: "cancelled"`` and why.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson

from broker.events import Event, EventType
from broker.request.generation import GenerationRequest
from broker.sse import DONE_FRAME, frame
from consumer.metrics import Metrics
from consumer.streaming.snapshots import AnswerSnapshot

log = logging.getLogger("rsb.consumer")

HEADERS = {"x-vercel-ai-ui-message-stream": "v1"}


def chunk_frame(chunk: dict[str, Any]) -> bytes:
    return frame(orjson.dumps(chunk))


def _error_frame(text: str) -> bytes:
    return chunk_frame({"type": "error", "errorText": text})


#: On a pod's shutdown the body must not just end: the SDK takes a clean end for a complete answer. An
#: error puts the chat in status "error" with this text; resumeStream() (any pod) continues the same turn.
SHUTDOWN_FRAME = _error_frame("rsb: this server is shutting down and the answer goes on; resume it "
                              "(resumeStream()) to continue")
_READ_FAILED = "rsb: reading the answer failed and the answer goes on; resume it (resumeStream()) to continue"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """rsb's usage as the SDK's LanguageModelUsage names it, plus rsb's timings."""
    u = usage or {}
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    out: dict[str, Any] = {"inputTokens": prompt, "outputTokens": completion, "totalTokens": prompt + completion}
    for ours, theirs in (("ttft_ms", "ttftMs"), ("tpot_ms", "tpotMs")):
        if u.get(ours) is not None:
            out[theirs] = u[ours]
    return out


def _finish_reason(reason: object) -> str:
    return {"stop": "stop", "length": "length", "tool_calls": "tool-calls"}.get(str(reason), "other")


class _Call:
    """A tool call being streamed: its id, name and arguments so far; ``settled`` once its input was sent."""

    __slots__ = ("id", "name", "pieces", "settled")

    def __init__(self, call_id: str, name: str) -> None:
        self.id, self.name, self.settled = call_id, name, False
        self.pieces: list[str] = []


class TurnChunks:
    """The chunks of one read of a turn, event by event: it remembers which text or reasoning part is open
    and the tool calls being streamed.

    ``message_id`` is the assistant message the turn writes: its stream id, or, for a turn that continues a
    message after its tool results (consumer.views.aisdk.request), that message's id, so the SDK puts the
    answer in the same message, as its next step."""

    def __init__(self, stream_id: uuid.UUID, message_id: str | None = None) -> None:
        self.message_id = message_id or str(stream_id)
        self.open: tuple[str, str] | None = None  # the open part: ("text" | "reasoning", its id)
        self.counts = {"text": 0, "reasoning": 0}
        self.calls: dict[int, _Call] = {}

    def opening(self, earlier_steps: bytes = b"") -> bytes:
        return (chunk_frame({"type": "start", "messageId": self.message_id}) + earlier_steps
                + chunk_frame({"type": "start-step"}))

    def _close_part(self) -> bytes:
        if self.open is None:
            return b""
        kind, part_id = self.open
        self.open = None
        return chunk_frame({"type": f"{kind}-end", "id": part_id})

    def _part(self, kind: str, text: str) -> bytes:
        """A piece of text or reasoning, in the open part of its kind (opened, the other one closed)."""
        out = b""
        if self.open is None or self.open[0] != kind:
            out = self._close_part() + self._settle_calls()
            # The first text part keeps the id it always had; every later part gets the next number.
            n = self.counts[kind]
            self.counts[kind] = n + 1
            self.open = (kind, f"{kind}-{n}")
            out += chunk_frame({"type": f"{kind}-start", "id": self.open[1]})
        return out + chunk_frame({"type": f"{kind}-delta", "id": self.open[1], "delta": text})

    def _settle_calls(self) -> bytes:
        """Each call whose arguments are complete (something else came after them) gets its input: parsed
        (``tool-input-available``: the SDK calls ``onToolCall``), or ``tool-input-error`` when its arguments
        are not JSON (the SDK's own answer to a model's malformed call: the error becomes the call's result)."""
        out = b""
        for call in self.calls.values():
            if call.settled:
                continue
            call.settled = True
            text = "".join(call.pieces)
            try:
                value = orjson.loads(text or "{}")
            except orjson.JSONDecodeError:
                out += chunk_frame({"type": "tool-input-error", "toolCallId": call.id, "toolName": call.name,
                                    "input": text, "errorText": "the model's arguments are not valid JSON"})
                continue
            out += chunk_frame({"type": "tool-input-available", "toolCallId": call.id, "toolName": call.name,
                                "input": value})
        return out

    def _answer(self, ev: Event) -> bytes | None:
        """The chunks of an event of the answer itself (None: ``ev`` is not one)."""
        if ev.type == EventType.DELTA:
            return self._part("text", ev.json()["text"])
        if ev.type == EventType.REASONING:
            return self._part("reasoning", ev.json()["text"])
        if ev.type == EventType.TOOL_CALL:
            data = ev.json()
            out = self._close_part() + self._settle_calls()
            self.calls[data["index"]] = _Call(data["id"], data["name"])
            return out + chunk_frame({"type": "tool-input-start", "toolCallId": data["id"], "toolName": data["name"]})
        if ev.type == EventType.TOOL_ARGS:
            data = ev.json()
            call = self.calls.get(data["index"])
            if call is None:
                return b""  # arguments of a call never begun: no engine sends that
            call.pieces.append(data["text"])
            return chunk_frame({"type": "tool-input-delta", "toolCallId": call.id, "inputTextDelta": data["text"]})
        return None

    def replay(self, events: Sequence[Event]) -> bytes:
        return b"".join([self.frames(ev) for ev in events])

    def frames(self, ev: Event) -> bytes:
        answer = self._answer(ev)
        if answer is not None:
            return answer
        if ev.type == EventType.QUEUED:
            return chunk_frame({"type": "data-rsb-queued", "data": ev.json(), "transient": True})
        if ev.type == EventType.PROGRESS:
            return chunk_frame({"type": "data-rsb-progress", "data": ev.json(), "transient": True})
        if ev.type == EventType.STARTED:
            return chunk_frame({"type": "message-metadata",
                                "messageMetadata": {"model": ev.json().get("model"), "status": "running"}})
        if not ev.is_terminal:
            return b""  # an event type this view does not know yet: nothing the SDK could accept
        data = ev.json()
        meta: dict[str, Any] = {"status": ev.type, "usage": _usage(data.get("usage"))}
        out = self._close_part()
        if ev.type == EventType.DONE:
            reason = data.get("finish_reason")
            meta["finishReason"] = reason
            out += self._settle_calls()
            out += chunk_frame({"type": "finish-step"})
            out += chunk_frame({"type": "finish", "finishReason": _finish_reason(reason), "messageMetadata": meta})
        elif ev.type == EventType.CANCELLED:
            # A call cut short stays "input-streaming": no result, so no automatic next request.
            meta["reason"] = data.get("reason")
            out += chunk_frame({"type": "finish-step"})
            out += chunk_frame({"type": "message-metadata", "messageMetadata": meta})
            out += chunk_frame({"type": "abort", "reason": str(data.get("reason") or "cancelled")})
        else:
            meta["code"] = data.get("code")
            out += chunk_frame({"type": "message-metadata", "messageMetadata": meta})
            out += _error_frame(str(data.get("message") or data.get("code") or "generation failed"))
        return out + DONE_FRAME


def earlier_steps(request: GenerationRequest | None) -> bytes:
    """The steps a continued message already had, as chunks, rebuilt from the turn's request (the messages
    after the last user or system message: the continued message's steps, and its calls' results).

    A resume needs them: the SDK starts a resumed message afresh at ``start`` (ai@6 and ai@7 always, ai@5 for a
    message it had not kept), so a replay of the continuation alone would drop the steps before it. Their calls
    go as ``tool-input-start`` + ``tool-input-delta`` (not ``tool-input-available``, which would make the
    SDK run the tool again) and their results as ``tool-output-available``. What the request does not keep is
    lost on that path: the steps' reasoning, and whether a result was an error (it shows as an output)."""
    messages = list(request.messages or ()) if request is not None else []
    start = len(messages)
    while start > 0 and messages[start - 1].role in ("assistant", "tool"):
        start -= 1
    results = {m.tool_call_id: m.content for m in messages[start:] if m.role == "tool"}
    out = b""
    for k, m in enumerate(messages[start:]):
        if m.role != "assistant":
            continue
        out += chunk_frame({"type": "start-step"})
        if m.content:
            part_id = f"text-step{k}"
            out += (chunk_frame({"type": "text-start", "id": part_id})
                    + chunk_frame({"type": "text-delta", "id": part_id, "delta": m.content})
                    + chunk_frame({"type": "text-end", "id": part_id}))
        for call in m.tool_calls:
            out += chunk_frame({"type": "tool-input-start", "toolCallId": call.id, "toolName": call.name})
            out += chunk_frame({"type": "tool-input-delta", "toolCallId": call.id, "inputTextDelta": call.arguments})
            if call.id in results:
                out += chunk_frame({"type": "tool-output-available", "toolCallId": call.id,
                                    "output": _output(results[call.id])})
        out += chunk_frame({"type": "finish-step"})
    return out


def _output(content: str) -> Any:
    """A result as the SDK had it: JSON text back as its value, any other text as it is."""
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return content


#: What takes back the answer's parts after a failover lost events a reader was sent (ai >= 7.0.70; the other majors'
#: closed chunk union refuses it, so a read sends it only when asked: ``?reset_step=1``).
RESET_STEP_FRAME = chunk_frame({"type": "reset-step"})


def _snapshot_frames(frames: bytes, last_id: str | None) -> bytes:
    """A snapshot's chunk frames, each under ``event: snapshot`` and the first with the snapshot's ``id:`` (its
    last event): the SDK's parser reads only their data lines, so they are the message so far to it, and a snapshot
    to anyone reading the SSE events."""
    out = []
    for i, f in enumerate(frames.split(b"\n\n")[:-1]):  # every frame is `data: <one line>` + a blank line
        head = b"id: " + last_id.encode() + b"\n" if i == 0 and last_id else b""
        out.append(head + b"event: snapshot\n" + f + b"\n\n")
    return b"".join(out)


async def turn_frames(batches: AsyncIterator[Sequence[Event] | AnswerSnapshot | None], stream_id: uuid.UUID,
                      metrics: Metrics, message_id: str | None = None, earlier: bytes = b"", *,
                      latest: bool = False, reset_step: bool = False) -> AsyncIterator[bytes | None]:
    """The turn from its start (``batches`` reads the stream from its first event), a batch per send;
    ``None`` when a heartbeat (an SSE comment, which the SDK skips) is due. ``message_id``: the message it
    continues (None: its own, named by the stream id); ``earlier``: that message's earlier steps (a resume).

    ``batches`` may hold snapshots (StreamService.latest): with ``latest`` the first item is one, the message so
    far (each run of its parts one start and one delta); a later one stands where a reset came: with ``reset_step``
    it follows a ``reset-step`` (the SDK drops the step's parts and takes the snapshot's), else the response ends
    there, without ``finish``, and the client's resume reads the turn as it now is."""
    turn = TurnChunks(stream_id, message_id)
    opening = turn.opening(earlier)
    if not latest:
        yield opening
    try:
        async for batch in batches:
            if batch is None:
                yield None
                continue
            if isinstance(batch, AnswerSnapshot):
                if latest:
                    latest = False
                    yield _snapshot_frames(opening + turn.replay(batch.events), batch.last_id)
                    continue
                if not reset_step:
                    return
                turn = TurnChunks(stream_id, message_id)
                yield _snapshot_frames(RESET_STEP_FRAME + turn.replay(batch.events), batch.last_id)
                continue
            yield b"".join(turn.frames(ev) for ev in batch)
            metrics.events_sent.inc(len(batch))
    except Exception:
        # The SDK would take the body's end for the whole answer: say it is not, so the page can resume.
        log.warning("aisdk read of %s failed", stream_id, exc_info=True)
        yield _error_frame(_READ_FAILED)
