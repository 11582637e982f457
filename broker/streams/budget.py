"""Token budgets per API key (``token_budget`` and ``budget_period`` in the keys file): what a key's generations
may use per UTC day or month, shared by every pod.

A create reserves its worst case, ``reservation``: an upper bound of its prompt's tokens (broker.request.
prompt_token_bound: the bytes of its canonical request) plus ``max_tokens``. The reservation is counted in
the create's own script (CREATE, ``budget_reserve``), refused when the period's used and reserved tokens and it
would pass the budget; so concurrent creates, on any pods, never reserve past it. When the generation ends, its
terminal event's script (FINISH, CANCEL: ``budget_settle``) takes the reservation back and counts what it really
used (prompt and completion tokens, never more than it reserved). Nothing else spends, so a key never spends
beyond what it reserved.

Where: one hash per key, period and partition (broker.streams.keys.budget_key, in the partition's slot: the create
and the terminal event count it in their own steps, on Redis Cluster too), fields ``reserved`` and ``used``; it
expires a while after its period ends (a generation that outlives its period settles into its own period's hash
while it exists, and into nothing after). With P partitions each holds ceil(budget / P), as for the other
per-caller limits (broker.streams.records.Quota.share). A stream remembers its reservation in its meta (``bkey``,
``bres``).
"""

from __future__ import annotations

import calendar
import math
from dataclasses import dataclass
from datetime import UTC, datetime

from broker.request import prompt_token_bound

#: How long a period's hash outlives the period: the longest a generation of it may still be running.
SETTLE_GRACE_S = 2 * 86_400


@dataclass(frozen=True, slots=True)
class Budget:
    """``tokens`` a key may use per ``period`` (``day`` or ``month``, UTC); 0: no budget."""

    tokens: int = 0
    period: str = "month"

    def share(self, partitions: int) -> int:
        return -(-self.tokens // partitions) if self.tokens > 0 else 0

    def window(self, now: float) -> tuple[str, float]:
        """The period ``now`` falls in: its name (``2026-12-03``, ``2026-12``) and its end (Unix seconds)."""
        t = datetime.fromtimestamp(now, UTC)
        if self.period == "day":
            start = datetime(t.year, t.month, t.day, tzinfo=UTC)
            return start.strftime("%Y-%m-%d"), start.timestamp() + 86_400
        days = calendar.monthrange(t.year, t.month)[1]
        start = datetime(t.year, t.month, 1, tzinfo=UTC)
        return start.strftime("%Y-%m"), start.timestamp() + days * 86_400

    def retry_after_s(self, now: float) -> int:
        """Seconds to the end of the period (when the budget is whole again), at least 1."""
        return max(1, math.ceil(self.window(now)[1] - now))


NO_BUDGET = Budget()


def reservation(canonical_request: bytes, max_tokens: int) -> int:
    """A create's worst case: an upper bound of its prompt's tokens, and all of its answer."""
    return prompt_token_bound(canonical_request) + max_tokens


#: Lua of the budget, for CREATE (``budget_reserve``) and the terminal events' scripts (``budget_settle``).
BUDGET_LUA = f"""
-- Reserve ``amount`` of ``share`` in ``key`` (a period's hash) for the stream ``meta``; false: it would pass the
-- budget. ``expire_at``: the period's end (Unix s). Call it after every other check of the create: it writes.
local function budget_reserve(key, meta, share, amount, expire_at)
  if share <= 0 then return true end
  local b = redis.call('HMGET', key, 'reserved', 'used')
  if tonumber(b[1] or '0') + tonumber(b[2] or '0') + amount > share then return false end
  redis.call('HINCRBY', key, 'reserved', amount)
  redis.call('EXPIREAT', key, tonumber(expire_at) + {SETTLE_GRACE_S})
  redis.call('HSET', meta, 'bkey', key, 'bres', amount)
  return true
end
-- The stream ``meta`` ended having used ``used`` tokens: its reservation is settled (once: it is then forgotten).
local function budget_settle(meta, used)
  local r = redis.call('HMGET', meta, 'bkey', 'bres')
  if not r[1] then return end
  redis.call('HDEL', meta, 'bkey', 'bres')
  if redis.call('EXISTS', r[1]) == 0 then return end
  local res = tonumber(r[2])
  redis.call('HINCRBY', r[1], 'reserved', -res)
  redis.call('HINCRBY', r[1], 'used', math.min(res, math.max(0, tonumber(used))))
end
"""
