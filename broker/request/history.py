"""Where a request's leading messages came from, when the server put them there: a conversation's turns, or a
previous response (broker.request.generation.GenerationRequest.history)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class History:
    """Where a request's leading messages came from, when the server put them there (a conversation's turns,
    or a previous response): set by the server, never read from a client's body. ``messages[:lead]`` are
    this request's own instructions (not carried into later turns), ``messages[lead:start]`` the history the
    server assembled, ``messages[start:]`` what the client sent new. For a conversation's turn, the rest names
    it (broker.streams.conversations): whose it is (``tenant``, the API key id), its ``conversation`` name,
    the conversation's ``version`` and how many turns it held when this one began (``turn``), and the
    client's ids of the new messages (``message_ids``: the AI SDK's UIMessage ids) and of the message its answer
    shows in (``answer_id``, when not the stream id: the AI SDK's assistant message a tool result continues).
    ``previous``: the stream id of the response this one continues (OpenAI's ``previous_response_id``)."""

    lead: int = 0
    start: int = 0
    conversation: str | None = None
    tenant: str = ""
    version: int = 0
    turn: int = 0
    message_ids: tuple[str, ...] = ()
    previous: str | None = None
    answer_id: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"lead": self.lead, "start": self.start, "conversation": self.conversation, "tenant": self.tenant,
                "version": self.version, "turn": self.turn, "message_ids": list(self.message_ids),
                "previous": self.previous, "answer_id": self.answer_id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> History:
        return cls(lead=d["lead"], start=d["start"], conversation=d["conversation"], tenant=d["tenant"],
                   version=d["version"], turn=d["turn"], message_ids=tuple(d["message_ids"]),
                   previous=d["previous"], answer_id=d.get("answer_id"))
