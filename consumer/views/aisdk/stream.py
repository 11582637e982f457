"""A turn's rsb events as the AI SDK's UI message stream (``x-vercel-ai-ui-message-stream: v1``): one
``data: <chunk JSON>`` frame per chunk, ``data: [DONE]`` after the last.

The chunks are a pure function of the stream's events, always read from the stream's first event: every
read of a turn (the POST that started it, a resume, a second tab) sends the same chunks, beginning with
``start`` and the turn's one message id (its stream id). The SDK replaces a message by id, so a replay
lands as one copy of the answer, never a second message; and it refuses a ``text-delta`` whose
``text-start`` it never saw, which is why a read never starts mid-turn.

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
from broker.sse import DONE_FRAME, frame
from consumer.metrics import Metrics

log = logging.getLogger("rsb.consumer")

HEADERS = {"x-vercel-ai-ui-message-stream": "v1"}
TEXT_PART_ID = "text-0"
_FINISH_REASONS = frozenset({"stop", "length"})


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


class TurnChunks:
    """The chunks of one read of a turn, event by event (it remembers whether the text part is open)."""

    def __init__(self, stream_id: uuid.UUID) -> None:
        self.message_id = str(stream_id)
        self.text_open = False

    def opening(self) -> bytes:
        return chunk_frame({"type": "start", "messageId": self.message_id}) + chunk_frame({"type": "start-step"})

    def _close_text(self) -> bytes:
        if not self.text_open:
            return b""
        self.text_open = False
        return chunk_frame({"type": "text-end", "id": TEXT_PART_ID})

    def frames(self, ev: Event) -> bytes:
        if ev.type == EventType.DELTA:
            out = b""
            if not self.text_open:
                self.text_open = True
                out = chunk_frame({"type": "text-start", "id": TEXT_PART_ID})
            return out + chunk_frame({"type": "text-delta", "id": TEXT_PART_ID, "delta": ev.json()["text"]})
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
        out = self._close_text()
        if ev.type == EventType.DONE:
            reason = data.get("finish_reason")
            meta["finishReason"] = reason
            out += chunk_frame({"type": "finish-step"})
            out += chunk_frame({"type": "finish", "finishReason": reason if reason in _FINISH_REASONS else "other",
                                "messageMetadata": meta})
        elif ev.type == EventType.CANCELLED:
            meta["reason"] = data.get("reason")
            out += chunk_frame({"type": "finish-step"})
            out += chunk_frame({"type": "message-metadata", "messageMetadata": meta})
            out += chunk_frame({"type": "abort", "reason": str(data.get("reason") or "cancelled")})
        else:
            meta["code"] = data.get("code")
            out += chunk_frame({"type": "message-metadata", "messageMetadata": meta})
            out += _error_frame(str(data.get("message") or data.get("code") or "generation failed"))
        return out + DONE_FRAME


async def turn_frames(batches: AsyncIterator[Sequence[Event] | None], stream_id: uuid.UUID,
                      metrics: Metrics) -> AsyncIterator[bytes | None]:
    """The turn from its start (``batches`` reads the stream from its first event), a batch per send;
    ``None`` when a heartbeat (an SSE comment, which the SDK skips) is due."""
    turn = TurnChunks(stream_id)
    yield turn.opening()
    try:
        async for batch in batches:
            if batch is None:
                yield None
                continue
            yield b"".join(turn.frames(ev) for ev in batch)
            metrics.events_sent.inc(len(batch))
    except Exception:
        # The SDK would take the body's end for the whole answer: say it is not, so the page can resume.
        log.warning("aisdk read of %s failed", stream_id, exc_info=True)
        yield _error_frame(_READ_FAILED)
