"""Commands from many concurrent callers, sent together: one pipeline per event-loop turn.

A consumer pod's readers attach in bursts (a drained pod's readers all reconnect at once; a page load opens
several): each reads its stream's status and its replay range. Sent one by one, a burst of two thousand
attaches makes thousands of round trips, each waiting its turn for one of the pool's few connections (the
pool's condition wakes the waiters one at a time) and each a write that wakes Redis. Here the commands issued
while a pipeline is in flight go out in the next one: the batch grows with the burst, a lone command still
takes one round trip, and the pool is touched once per batch. Each command keeps its own reply or error.

Only for commands that are safe to batch with anything (plain reads and single-command writes): a pipeline
here is not a transaction. Standalone and Sentinel clients only; on Redis Cluster a pipeline would be split
by node anyway, and commands go on their own (``direct``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from broker.errors import StoreError, StoreUnavailable
from broker.redis.connection import RedisClient, Script, is_cluster

# Commands per pipeline: bounds one batch's reply (and the time Redis spends on it before answering others).
MAX_BATCH = 256


class CommandBatcher:
    def __init__(self, client: RedisClient, max_batch: int = MAX_BATCH) -> None:
        self.client = client
        self.max_batch = max_batch
        self.direct = is_cluster(client) or not isinstance(client, Redis)
        self._pending: list[tuple[tuple[Any, ...], dict[str, Any], asyncio.Future[Any]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._in_flight = 0  # plain commands out now, and the batch task while it runs

    async def execute(self, *args: Any, **options: Any) -> Any:
        """``client.execute_command(*args, **options)``, batched with the commands of other callers."""
        if self.direct:
            return await self.client.execute_command(*args, **options)
        if not self._in_flight and not self._pending:
            # Nothing else in flight: this command goes at once, as a plain command (a lone resume pays no
            # hand-off to the batch task); the commands that come while it is out are batched.
            self._in_flight += 1
            try:
                return await self.client.execute_command(*args, **options)
            finally:
                self._in_flight -= 1
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((args, options, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return await fut

    async def script(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        """A registered script (broker.redis.connection.register_script), batched as EVALSHA; a script Redis
        does not have (restarted, flushed) is loaded by the script object's own call."""
        if self.direct:
            return await script(keys=keys, args=args)
        try:
            return await self.execute("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await script(keys=keys, args=args)

    async def _flush(self) -> None:
        # A task starts on the loop's next turn: every command queued in the turn that queued the first (and
        # while a batch is in flight) goes with it.
        self._in_flight += 1
        try:
            await self._send_batches()
        finally:
            self._in_flight -= 1

    async def _send_batches(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            live = [(args, options, fut) for args, options, fut in batch if not fut.done()]  # callers that left
            if not live:
                continue
            try:
                if len(live) == 1:  # alone (an ordinary resume): as a plain command, without a pipeline's costs
                    args, options, _ = live[0]
                    try:
                        replies: list[Any] = [await self.client.execute_command(*args, **options)]
                    except StoreUnavailable:
                        raise
                    except (StoreError, NoScriptError) as e:  # that caller's error, as a pipeline would hand it back
                        replies = [e]
                else:
                    async with self.client.pipeline(transaction=False) as pipe:
                        for args, options, _ in live:
                            pipe.execute_command(*args, **options)
                        replies = await pipe.execute(raise_on_error=False)
            except BaseException as e:  # the connection failed: every caller gets the error (and may retry)
                for _, _, fut in live:
                    if not fut.done():
                        fut.set_exception(e if isinstance(e, Exception) else StoreUnavailable(str(e)))
                if not isinstance(e, Exception):
                    raise
                continue
            for (_, _, fut), reply in zip(live, replies, strict=True):
                if fut.done():
                    continue
                if isinstance(reply, Exception):
                    fut.set_exception(reply)
                else:
                    fut.set_result(reply)
