"""Reading a pub/sub connection's replies: data messages handed on as they come, anything else to its shard.

A data message (every token of every tailed stream) is handed on from the raw reply, without the dict and the
handler lookups redis-py builds for it; subscribe and unsubscribe replies go to the shard's ``handle``, which keeps
the subscriptions' bookkeeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import hiredis
from redis._parsers.hiredis import NOT_ENOUGH_DATA
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError

OnMessage = Callable[[bytes, bytes], None]
#: Handles a reply that is not a data message (a confirmation, an unsubscribe, a pong).
OnReply = Callable[[PubSub, Any], Awaitable[None]]

# A dispatch loop wakes at least this often even when no message comes (cheap; lets cancellation in).
_IDLE_WAKE_S = 30.0
# One socket read of the raw dispatch loop: at most this many bytes of messages are handed on per loop turn.
_READ_BYTES = 1 << 18


async def dispatch(ps: PubSub, msg_kind: bytes, on_message: OnMessage, on_reply: OnReply,
                   heard: Callable[[float], None]) -> None:
    """Read ``ps`` until it fails: ``msg_kind`` messages (``b"message"``, ``b"smessage"``) to ``on_message``, other
    replies to ``on_reply``; ``heard`` gets the loop's time whenever Redis was heard (for liveness.watch)."""
    parser = getattr(ps.connection, "_parser", None)
    reader, stream = getattr(parser, "_reader", None), getattr(parser, "_stream", None)
    if isinstance(reader, hiredis.Reader) and isinstance(stream, asyncio.StreamReader):
        await _dispatch_raw(ps, reader, stream, msg_kind, on_message, on_reply, heard)
        return
    clock = asyncio.get_running_loop().time
    while True:
        # get_message is parse_response + handle_message: a data message skips the latter.
        response: Any = await ps.parse_response(block=False, timeout=_IDLE_WAKE_S)
        if not response:
            continue
        heard(clock())
        if response[0] == msg_kind and len(response) == 3:
            on_message(response[1], response[2])
            continue
        await on_reply(ps, response)


async def _dispatch_raw(ps: PubSub, reader: hiredis.Reader, stream: asyncio.StreamReader, msg_kind: bytes,
                        on_message: OnMessage, on_reply: OnReply, heard: Callable[[float], None]) -> None:
    """The dispatch loop on the connection's own hiredis reader: one socket read, then every reply it
    completed, handed on in one go. Through ``parse_response`` each message cost a timeout context, the
    retry wrapper and the push-handler chain (half of a consumer pod's CPU with a thousand live streams,
    docs/benchmarks.md); here a message costs one ``gets()`` and the hub's callback. The readers woken by
    one read's messages run after all of them are handed on, so each writes them in one send."""
    gets, feed = reader.gets, reader.feed
    clock = asyncio.get_running_loop().time
    while True:
        reply: Any = gets()
        if reply is NOT_ENOUGH_DATA:
            data = await stream.read(_READ_BYTES)
            if not data:
                raise RedisConnectionError("the pub/sub connection was closed by the server")
            heard(clock())
            feed(data)
            continue
        if isinstance(reply, list) and len(reply) == 3 and reply[0] == msg_kind:  # hiredis: a PushNotification
            on_message(reply[1], reply[2])
            continue
        if isinstance(reply, Exception):
            raise reply
        await on_reply(ps, reply)
