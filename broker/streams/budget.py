"""Budgets: what the generations of an API key, and of a team of keys, may use per UTC day or month, in tokens and in
money, shared by every pod. A key's are ``token_budget``, ``usd_budget`` and ``budget_period`` in the keys file; a
team's (``team`` in a key's entry) the same fields in ``--teams FILE`` (``Teams``). A create is admitted only if
every budget it falls under (its key's, its team's) holds its worst case, all checked and reserved in one step.

A create reserves its worst case, ``reservation``: an upper bound of its prompt's tokens (broker.request.generation.
prompt_token_bound: the bytes of its canonical request) plus ``max_tokens``; in money, those tokens at its
model's price in its tier (``usd_reservation``: the prompt at the dearer of the input and cached-input prices, the
answer at the output price; broker.streams.usage.Prices, ``--prices``). The reservation is counted in the create's
own script (CREATE: ``budget_fits`` for each budget, then ``budget_hold``), refused when a budget's used and
reserved amounts and it would pass the budget; so concurrent creates, on any pods, never reserve past it. When the
generation ends, its terminal event's script (FINISH, CANCEL: ``budget_settle``) takes the reservation back from
every budget it held and counts what it really used (prompt and completion tokens, and their cost at the price the
create reserved at, cached prompt tokens at the cached price; never more than it reserved). Nothing else spends,
so a key or a team never spends beyond what it reserved.

Where: one hash per holder (a key, or ``t:<team>``), period and partition (broker.streams.keys.budget_key, in the
partition's slot: the create and the terminal event count it in their own steps, on Redis Cluster too), fields
``reserved`` and ``used`` (tokens), ``ureserved`` and ``uused`` (nano-USD, integers); it expires a while after its
period ends (a generation that outlives its period settles into its own period's hashes while they exist, and into
nothing after). With P partitions each holds ceil(budget / P), as for the other per-caller limits
(broker.streams.records.Quota.share). A stream remembers what it reserved in its meta: ``bkey`` and ``tkey`` (the
key's and the team's hash, each only if held), ``bres`` (tokens), ``bures`` (nano-USD) and ``bprice`` (the
price, USD per million input, cached input and output tokens).
"""

from __future__ import annotations

import calendar
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from broker.redis.keyspace import partition_share
from broker.request.generation import prompt_token_bound
from broker.streams.usage import Price, json_object

#: How long a period's hash outlives the period: the longest a generation of it may still be running.
SETTLE_GRACE_S = 2 * 86_400


#: Money is counted in nano-USD, whole numbers (HINCRBY), so that no rounding adds up over millions of records.
NANO_PER_USD = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Budget:
    """What one holder may use per ``period`` (``day`` or ``month``, UTC): ``tokens`` and ``usd`` (0: no bound).
    ``holder`` names its hashes (broker.streams.keys.budget_key): the API key's id, or ``t:<team>``; ``label`` says
    whose it is in a refusal."""

    tokens: int = 0
    period: str = "month"
    usd: float = 0.0
    holder: str = ""
    label: str = "this API key's"

    @property
    def bounded(self) -> bool:
        return self.tokens > 0 or self.usd > 0

    def share(self, partitions: int) -> int:
        return partition_share(self.tokens, partitions)

    def usd_share(self, partitions: int) -> int:
        """This partition's share of the money, in nano-USD (0: no bound)."""
        return partition_share(round(self.usd * NANO_PER_USD), partitions)

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

    def refusal(self, what: str, partitions: int, tokens: int, usd_nano: int) -> str:
        """Why a create of worst case ``tokens`` (``usd_nano`` nano-USD) does not fit its ``what`` ('tokens' or
        'usd') budget: the message of its 429."""
        if what == "usd":
            share = f" (${self.usd_share(partitions) / NANO_PER_USD:g} in each of {partitions} partitions)" \
                if partitions > 1 else ""
            return (f"{self.label} budget (${self.usd:g} a {self.period}{share}) cannot hold this generation's worst "
                    f"case (${usd_nano / NANO_PER_USD:.6f}: its prompt's bytes at the input price and max_tokens at "
                    "the output price of its model in its tier, --prices); it renews at the period's end (UTC)")
        share = f" ({self.share(partitions)} in each of {partitions} partitions)" if partitions > 1 else ""
        return (f"{self.label} token budget ({self.tokens} tokens a {self.period}{share}) cannot hold this "
                f"generation's worst case ({tokens} tokens: its prompt's bytes and max_tokens); it renews at the "
                "period's end (UTC)")


NO_BUDGET = Budget()
BUDGET_FIELDS = ("token_budget", "usd_budget", "budget_period")
PERIODS = ("day", "month")
TEAM_NAME = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")


def parse_budget(entry: dict[str, Any], holder: str, label: str, where: str) -> Budget:
    """``token_budget``, ``usd_budget`` and ``budget_period`` of a keys-file or teams-file entry, checked: a wrong
    type is a ValueError naming ``where`` and the field."""
    tokens, usd, period = (entry.get("token_budget", 0), entry.get("usd_budget", 0.0),
                           entry.get("budget_period", "month"))
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"{where}: 'token_budget' must be a whole number of tokens (0: none)")
    if isinstance(usd, bool) or not isinstance(usd, int | float) or not math.isfinite(usd) or usd < 0:
        raise ValueError(f"{where}: 'usd_budget' must be a number of USD (0: none)")
    if period not in PERIODS:
        raise ValueError(f"{where}: 'budget_period' must be one of {', '.join(PERIODS)}")
    return Budget(tokens, period, float(usd), holder, label)


class Teams:
    """``--teams FILE``: ``{"<name>": {"token_budget"?: int, "usd_budget"?: float, "budget_period": "day" |
    "month"}}``. Names as key ids (broker.streams.keys.tenant_of: no ``:``)."""

    def __init__(self, budgets: dict[str, Budget]) -> None:
        self.budgets = budgets

    @classmethod
    def parse(cls, raw: bytes, source: str = "teams") -> Teams:
        data = json_object(raw, source, f"an object of teams, each {{{', '.join(BUDGET_FIELDS)}}}")
        budgets: dict[str, Budget] = {}
        for name, entry in data.items():
            if not TEAM_NAME.match(name):
                raise ValueError(f"{source}: team {name!r}: use letters, digits, '_' and '-' (at most 64)")
            if not isinstance(entry, dict) or set(entry) - set(BUDGET_FIELDS):
                raise ValueError(f"{source}: team {name!r}: expected an object of {', '.join(BUDGET_FIELDS)}")
            budgets[name] = parse_budget(entry, team_holder(name), f"team {name}'s", f"{source}: team {name!r}")
        return cls(budgets)

    @classmethod
    def load(cls, path: str | Path) -> Teams:
        return cls.parse(Path(path).read_bytes(), str(path))

    def get(self, name: str) -> Budget | None:
        return self.budgets.get(name)


def team_holder(name: str) -> str:
    """A team's budgets' holder name: key ids hold no ``:``, so a team never shares a key's hashes."""
    return f"t:{name}"


def reservation(canonical_request: bytes, max_tokens: int) -> int:
    """A create's worst case: an upper bound of its prompt's tokens, and all of its answer."""
    return prompt_token_bound(canonical_request) + max_tokens


def usd_reservation(price: Price | None, canonical_request: bytes, max_tokens: int) -> int:
    """A create's worst case in nano-USD: its prompt bound at the dearer input price, all of its answer at the
    output price (0: unpriced)."""
    if price is None:
        return 0
    prompt_price = max(price.input_per_mtok, price.cached_input_per_mtok)
    return math.ceil((prompt_token_bound(canonical_request) * prompt_price + max_tokens * price.output_per_mtok)
                     * NANO_PER_USD / 1e6)


def price_field(price: Price | None) -> str:
    """A stream's ``bprice``: the price its usage settles at ('': unpriced)."""
    if price is None:
        return ""
    return " ".join(repr(float(v)) for v in (price.input_per_mtok, price.cached_input_per_mtok, price.output_per_mtok))


#: Lua of the budgets, for CREATE (``budget_fits``, ``budget_hold``) and the terminal events' scripts
#: (``budget_settle``).
BUDGET_LUA = f"""
-- What ``amount`` tokens and ``usd`` nano-USD more would pass in the budget hash ``key`` ('tokens', 'usd'), or nil
-- when they fit (shares 0: no bound).
local function budget_fits(key, share, ushare, amount, usd)
  if share <= 0 and ushare <= 0 then return nil end
  local b = redis.call('HMGET', key, 'reserved', 'used', 'ureserved', 'uused')
  if share > 0 and tonumber(b[1] or '0') + tonumber(b[2] or '0') + amount > share then return 'tokens' end
  if ushare > 0 and tonumber(b[3] or '0') + tonumber(b[4] or '0') + usd > ushare then return 'usd' end
  return nil
end
-- Reserve them in ``key`` (a period's hash, expiring a grace after ``expire_at``, the period's end in Unix s).
local function budget_hold(key, amount, usd, expire_at)
  redis.call('HINCRBY', key, 'reserved', amount)
  redis.call('HINCRBY', key, 'ureserved', usd)
  redis.call('EXPIREAT', key, tonumber(expire_at) + {SETTLE_GRACE_S})
end
-- The stream ``meta`` ended having used ``prompt`` tokens (``cached`` of them from a cache) and ``completion``:
-- its reservation is settled in every hash it held (once: it is then forgotten).
local function budget_settle(meta, prompt, cached, completion)
  local r = redis.call('HMGET', meta, 'bkey', 'tkey', 'bres', 'bures', 'bprice')
  if not r[1] and not r[2] then return end
  redis.call('HDEL', meta, 'bkey', 'tkey', 'bres', 'bures', 'bprice')
  prompt, completion = math.max(0, tonumber(prompt)), math.max(0, tonumber(completion))
  cached = math.min(math.max(0, tonumber(cached)), prompt)
  local res, ures = tonumber(r[3] or '0'), tonumber(r[4] or '0')
  local used = math.min(res, prompt + completion)
  local uused = 0
  if r[5] and r[5] ~= '' then
    local p = {{}}
    for v in string.gmatch(r[5], '%S+') do p[#p + 1] = tonumber(v) end
    local cost = ((prompt - cached) * p[1] + cached * p[2] + completion * p[3]) * {NANO_PER_USD} / 1e6
    uused = math.min(ures, math.ceil(cost))
  end
  for _, key in ipairs({{r[1], r[2]}}) do
    if key and redis.call('EXISTS', key) == 1 then
      redis.call('HINCRBY', key, 'reserved', string.format('%d', -res))
      redis.call('HINCRBY', key, 'used', string.format('%d', used))
      redis.call('HINCRBY', key, 'ureserved', string.format('%d', -ures))
      redis.call('HINCRBY', key, 'uused', string.format('%d', uused))
    end
  end
end
"""
