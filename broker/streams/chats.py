"""Chats: which rsb stream is a chat's latest turn, per API key (for the Vercel AI SDK view).

A chat is many turns and each turn is one rsb stream. All a chat needs in Redis is one pointer per (API
key, chat id): the latest turn's stream id and its turn key (what tells a repeat of the same request from
a new one). The pointer is a key of its own (broker.streams.keys.chat_key), in another hash slot than its turns'
streams on Redis Cluster, so no script can touch both. A turn stays atomic anyway:

- its stream id is derived (uuid5) from the key id, the chat id, the turn key and the stream id of the
  turn the request found latest (``turn_stream_id``), so identical requests name the same stream however
  concurrent they are, and the stream's CREATE, idempotent per stream id, is the one step that makes a
  generation;
- then the pointer moves by compare-and-set from the value that request read (ADVANCE_TURN, whose comment
  names the race).

A process dying between the two leaves a created turn that no pointer names: the request that made it
still serves it, and a retry (same body, same pointer read) derives the same id, finds the stream created
and moves the pointer. Including the previous turn in the id is what lets the same body start a new turn
once the previous one is over (two "regenerate" clicks send identical bodies).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from broker.redis.connection import RedisClient
from broker.streams import scripts
from broker.streams.keys import chat_key

# Turn stream ids live in their own uuid5 namespace (see turn_stream_id).
_TURN_NAMESPACE = uuid.UUID("0d5b6f3e-8c1a-4f6e-a2b9-3c7d9e4f1a20")
#: The pointer outlives its turn's start by the retention plus this margin: it must outlast the generation
#: itself (which may run longer than the retention), and a pointer to an expired turn reads as "no turn".
POINTER_MARGIN_S = 86_400


@dataclass(frozen=True, slots=True)
class Turn:
    stream_id: uuid.UUID
    turn_key: str


def turn_stream_id(key_id: str, chat_id: str, turn_key: str, previous: uuid.UUID | None) -> uuid.UUID:
    """The stream id of a chat's turn: the same for the same request made on top of the same latest turn."""
    return uuid.uuid5(_TURN_NAMESPACE, f"{key_id}\n{chat_id}\n{turn_key}\n{previous or ''}")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class ChatStore:
    """The chat pointers. Works unchanged on Redis Cluster: every call touches one key."""

    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis
        self._advance = redis.register_script(scripts.ADVANCE_TURN)

    async def latest(self, key_id: str, chat_id: str) -> Turn | None:
        """The chat's latest turn for this API key (None: it has none, or another key's chat has this id)."""
        sid, turn = await self.redis.hmget(chat_key(key_id, chat_id), ["sid", "turn"])
        if sid is None:
            return None
        return Turn(uuid.UUID(_text(sid)), _text(turn or ""))

    async def advance(self, key_id: str, chat_id: str, previous: uuid.UUID | None, turn: Turn, ttl_s: int) -> bool:
        """Make ``turn`` the chat's latest if the latest is still ``previous`` (or already ``turn``); False when
        another new turn got there first (it stays the latest)."""
        now = await self._advance(keys=[chat_key(key_id, chat_id)],
                                  args=[str(previous or ""), str(turn.stream_id), turn.turn_key, ttl_s])
        return _text(now) == str(turn.stream_id)
