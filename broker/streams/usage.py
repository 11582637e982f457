"""The usage ledger: one record per generation that reached a terminal status, written by the script that appends
its terminal event (broker.streams.scripts, ``record_usage``), so a record exists exactly when the terminal event
does, once, whatever crashed or raced. broker.streams.usage_report reads it.

Where (broker.streams.keys.usage_log_prefix; per API key and partition, so that a key's report reads only its own,
'-' for the generations made without API keys):
- billed records (any prompt or completion token: something to pay for) in one Redis Stream, kept by time only:
  ``usage_retention_s`` (the stream's ``urs``, from --usage-retention-days at its create), trimmed by each write of
  its key's log, and the log expires that long after its last record. Nothing a key does pushes one out early;
- free records (no token: a create cancelled while queued, say) in another, kept as long but at most FREE_RECORDS
  (the oldest go first), so a flood of them costs a bounded amount and never touches a billed one;
- the sums of each key's records per UTC day, by model, tier, status and reason, in one hash per key and day, added
  to by the same script: a report reads these days' rows, not their records (records only for the part of a day its
  bounds cut). A day's hash expires with its records;
- a sorted set per partition of the key ids that have records (``usage_index_key``), for a report of every key.
Entry ids are the Redis server's millisecond timestamps, so a time range is an id range, and the day of a record
is the day of its id.

Storage: a billed record counts RECORD_BYTES in its creator's storage quota (broker.redis.quota: the stream's ``qs``)
until it leaves the ledger (an item per day, expiring with it). Free records are bounded by their count instead.

A record's fields (RECORD_FIELDS): ``sid``; ``ts`` (Unix seconds of the end); ``key`` (the API key id, '' without
keys); ``model`` (the model that ran, or that was asked for when it never ran); ``tier`` (the service tier that
ran, ``default`` without one); ``status`` (done, cancelled, error); ``reason`` (done: its finish reason; cancelled:
its reason; error: its code); ``max_tokens``; ``prompt_tokens``, ``cached_tokens`` (of them, served from a prompt
cache), ``completion_tokens`` (the tokens the stream holds: every attempt's), ``wasted_tokens`` (computed by an
attempt that was lost and not kept: see generator.generation); ``compute_s`` (engine time of the attempt that
ended it); ``queue_s`` (from the create to the claim of the attempt that ended it, or to the end when it never
ran); ``ttft_ms`` ('' when no token came). A day's sums: DAY_COUNTERS, each field
``<counter> <JSON [model, tier, status, reason]>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from broker.redis.keyspace import lua_builders
from broker.redis.lua import SERVER_MS
from broker.request.tiers import DEFAULT as DEFAULT_TIER
from broker.request.tiers import TIERS
from broker.streams.keys import USAGE_DAY, USAGE_FREE, USAGE_LOG

#: Days a usage record is kept by default (--usage-retention-days): this month's bill and the two before.
RETENTION_DAYS = 93
RETENTION_S = RETENTION_DAYS * 86_400
#: The one help text of --usage-retention-days (the API's, which records keep, and ``rsb report``'s, which it reads).
RETENTION_HELP = ("days a usage record is kept: billed records for this long whatever else the key does, its free "
                  "ones (no tokens) at most 10,000 per key and partition; reports read no older ones")
DAY_S = 86_400
#: Free records one key's log holds in one partition at most (XADD MAXLEN ~): the oldest are trimmed first.
FREE_RECORDS = 10_000
#: What a billed record counts in its creator's storage quota: its entry (measured: 20,000 records in one log,
#: MEMORY USAGE 3,883,156 bytes, 195 a record) and its share of the day's sums.
RECORD_BYTES = 256

RECORD_FIELDS = ("sid", "ts", "key", "model", "tier", "status", "reason", "max_tokens", "prompt_tokens",
                 "cached_tokens", "completion_tokens", "wasted_tokens", "compute_s", "queue_s", "ttft_ms")
#: The sums a day's hash keeps of its records (``tokens_saved``: max_tokens less the completion, for the aborted
#: report).
DAY_COUNTERS = ("streams", "prompt_tokens", "cached_tokens", "completion_tokens", "wasted_tokens", "tokens_saved",
                "compute_s")

Record = dict[str, str]

#: The Lua that writes a generation's usage record, for the terminal events' scripts (broker.streams.scripts, which
#: include broker.redis.quota's Lua before it): in its key's log of this partition, its day's sums, the index, and
#: its creator's storage quota. Names are built from ``prefix`` (broker.streams.keys.usage_log_prefix: same slot)
#: and the stream's ``key_id``. What the stream's meta knows (key, tier, max_tokens, times, tokens a lost attempt
#: wasted, its storage quota's key ``qs``, the retention ``urs``) is read here; the rest is the ending attempt's.
#: ``meta`` fields: ``created_at`` and ``started_at`` (s, the server's time of the create and of the first claim:
#: ``queue_s`` is the wait between them, wholly in one clock; a record of a stream never claimed waited until its
#: end); ``wasted`` (tokens lost attempts reported:
#: broker.streams.job_store.JobStore.add_wasted).
RECORD_USAGE_LUA = SERVER_MS + lua_builders(usage_log=USAGE_LOG, usage_free=USAGE_FREE, usage_day=USAGE_DAY) + f"""
local function record_usage(index, prefix, rollups_since, meta, sid, status, reason, model, prompt_tokens,
                            cached_tokens, completion_tokens, wasted_tokens, compute_s, ttft_ms)
  local m = redis.call('HMGET', meta, 'key_id', 'tier', 'max_tokens', 'created_at', 'started_at', 'wasted', 'qs',
    'urs')
  local key = m[1] or ''
  local name = key ~= '' and key or '-'
  local now_ms = server_ms()
  local now_s = string.format('%.6f', now_ms / 1000)
  local started = now_ms / 1000
  if m[5] then started = tonumber(m[5]) end
  local queue_s = ''
  if m[4] then queue_s = string.format('%.3f', started - tonumber(m[4])) end
  local wasted = tonumber(wasted_tokens) + tonumber(m[6] or '0')
  local tier = (m[2] and m[2] ~= '') and m[2] or '{DEFAULT_TIER}'
  local keep_s = tonumber(m[8] or '{RETENTION_S}')
  local day = math.floor(now_ms / {DAY_S * 1000})
  -- The first record with day sums: on a ledger that had records, its day and those before are read as records.
  if redis.call('EXISTS', rollups_since) == 0 then
    redis.call('SET', rollups_since, redis.call('EXISTS', index) == 1 and day or -1)
  end
  local billed = tonumber(prompt_tokens) + tonumber(completion_tokens) > 0
  local log = billed and usage_log(prefix, name) or usage_free(prefix, name)
  local fields = {{'sid', sid, 'ts', now_s, 'key', key, 'model', model or '', 'tier', tier, 'status', status,
    'reason', reason, 'max_tokens', m[3] or '0', 'prompt_tokens', prompt_tokens, 'cached_tokens', cached_tokens,
    'completion_tokens', completion_tokens, 'wasted_tokens', wasted, 'compute_s', compute_s, 'queue_s', queue_s,
    'ttft_ms', ttft_ms}}
  if billed then
    redis.call('XADD', log, '*', unpack(fields))
  else
    redis.call('XADD', log, 'MAXLEN', '~', {FREE_RECORDS}, '*', unpack(fields))
  end
  redis.call('XTRIM', log, 'MINID', '~', string.format('%d', now_ms - keep_s * 1000))
  redis.call('EXPIRE', log, keep_s)
  local sums = usage_day(prefix, name, day)
  local g = ' ' .. cjson.encode({{model or '', tier, status, reason}})
  local saved = math.max(0, tonumber(m[3] or '0') - tonumber(completion_tokens))
  redis.call('HINCRBY', sums, 'streams' .. g, 1)
  redis.call('HINCRBY', sums, 'prompt_tokens' .. g, prompt_tokens)
  redis.call('HINCRBY', sums, 'cached_tokens' .. g, cached_tokens)
  redis.call('HINCRBY', sums, 'completion_tokens' .. g, completion_tokens)
  redis.call('HINCRBY', sums, 'wasted_tokens' .. g, wasted)
  redis.call('HINCRBY', sums, 'tokens_saved' .. g, saved)
  redis.call('HINCRBYFLOAT', sums, 'compute_s' .. g, compute_s)
  redis.call('EXPIREAT', sums, (day + 1) * {DAY_S} + keep_s)
  redis.call('ZADD', index, now_ms, name)
  redis.call('ZREMRANGEBYSCORE', index, '-inf', now_ms - keep_s * 1000)
  if billed and m[7] then
    local item = 'usage:' .. day
    quota_charge(m[7], item, {RECORD_BYTES})
    quota_expire(m[7], item, string.format('%d', ((day + 1) * {DAY_S} + keep_s) * 1000))
  end
end
"""

_PRICE_FIELDS = ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok")


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens of one model (in one service tier)."""

    input_per_mtok: float
    cached_input_per_mtok: float
    output_per_mtok: float

    def cost_of(self, prompt: int, cached: int, completion: int) -> float:
        """What these tokens cost: the uncached prompt tokens, the cached ones and the completion. The tokens a lost
        attempt wasted are rsb's loss, not the caller's: never priced."""
        cached = min(cached, prompt)
        return ((prompt - cached) * self.input_per_mtok + cached * self.cached_input_per_mtok
                + completion * self.output_per_mtok) / 1e6


class Prices:
    """``--prices FILE``: ``{"<model>": {"input_per_mtok": float, "cached_input_per_mtok": float,
    "output_per_mtok": float, "tiers"?: {"<tier>": {...the same fields}}}}`` (``cached_input_per_mtok`` defaults to
    the input price; a tier's fields each default to the model's own): a generation is priced at its model's
    price in the service tier it ran in (broker.request.tiers)."""

    def __init__(self, by_model: dict[str, Price], by_tier: dict[tuple[str, str], Price] | None = None) -> None:
        self.by_model = by_model
        self.by_tier = by_tier or {}

    @classmethod
    def parse(cls, raw: bytes, source: str = "prices") -> Prices:
        data = json_object(raw, source, f"an object of models, each {{{', '.join(_PRICE_FIELDS)}}}")
        out: dict[str, Price] = {}
        tiered: dict[tuple[str, str], Price] = {}
        for model, entry in data.items():
            if not isinstance(entry, dict) or set(entry) - {*_PRICE_FIELDS, "tiers"}:
                raise ValueError(f"{source}: {model!r}: expected an object with {', '.join(_PRICE_FIELDS)} (and "
                                 "'tiers')")
            base = out[model] = _price(entry, {"cached_input_per_mtok": entry.get("input_per_mtok")},
                                       f"{source}: {model!r}")
            by_tier = entry.get("tiers", {})
            if not isinstance(by_tier, dict) or set(by_tier) - set(TIERS):
                raise ValueError(f"{source}: {model!r}: 'tiers' is an object of {', '.join(TIERS)}")
            for tier, fields in by_tier.items():
                if not isinstance(fields, dict) or set(fields) - set(_PRICE_FIELDS):
                    raise ValueError(f"{source}: {model!r}: tier {tier!r}: expected an object of "
                                     f"{', '.join(_PRICE_FIELDS)}")
                defaults = {n: getattr(base, n) for n in _PRICE_FIELDS}
                tiered[(model, tier)] = _price(fields, defaults, f"{source}: {model!r}: tier {tier!r}")
        return cls(out, tiered)

    @classmethod
    def load(cls, path: str | Path) -> Prices:
        return cls.parse(Path(path).read_bytes(), str(path))

    def price(self, model: str, tier: str = DEFAULT_TIER) -> Price | None:
        """The price of ``model`` in ``tier`` (None: the model is not priced)."""
        return self.by_tier.get((model, tier)) or self.by_model.get(model)


def json_object(raw: bytes, source: str, expected: str) -> dict[str, Any]:
    """An operator's JSON file that holds an object (--prices, --teams); a ValueError naming ``source`` else."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{source}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected {expected}")
    return data


def _price(entry: dict[str, Any], defaults: dict[str, Any], where: str) -> Price:
    values = {**defaults, **entry}
    for name in _PRICE_FIELDS:
        v = values.get(name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: {name} must be a number of USD, 0 or more")
    return Price(*(float(values[n]) for n in _PRICE_FIELDS))
