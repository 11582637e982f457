"""The usage ledger: one record per generation that reached a terminal status, written by the script that appends
its terminal event (broker.streams.scripts, ``record_usage``), so a record exists exactly when the terminal event
does, once, whatever crashed or raced.

Where: one Redis Stream per API key and partition (broker.streams.keys.usage_log_key; without API keys, one for
the key id ''), so that a key's report reads only its own records, and a sorted set per partition of the key ids
that have records (``usage_index_key``), for a report of every key. Entry ids are millisecond timestamps, so a time
range is an id range.

A record's fields (RECORD_FIELDS): ``sid``; ``ts`` (Unix seconds of the end); ``key`` (the API key id, '' without
keys); ``model`` (the model that ran, or that was asked for when it never ran); ``tier`` (the service tier that
ran, ``default`` without one); ``status`` (done, cancelled, error); ``reason`` (done: its finish reason; cancelled:
its reason; error: its code); ``max_tokens``; ``prompt_tokens``, ``cached_tokens`` (of them, served from a prompt
cache), ``completion_tokens`` (the tokens the stream holds: every attempt's), ``wasted_tokens`` (computed by an
attempt that was lost and not kept: see generator.generation); ``compute_s`` (engine time of the attempt that
ended it); ``queue_s`` (from the create to the first claim, or to the end when it never ran); ``ttft_ms``
('' when no token came).

Bounds (RETENTION_DAYS, MAX_RECORDS): a record is kept RETENTION_DAYS (trimmed by each write of its key's log, and
a key's log expires RETENTION_DAYS after its last record), and a key's log in one partition holds at most about
MAX_RECORDS (the oldest go first). docs/operations.md gives the memory a record takes.
"""

from __future__ import annotations

import csv
import io
import math
import re
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from broker.errors import InvalidRequest
from broker.redis.connection import RedisClient, reply_text
from broker.redis.lua import SERVER_MS
from broker.streams.keys import usage_index_key, usage_log_key
from broker.tiers import DEFAULT as DEFAULT_TIER
from broker.tiers import TIERS

#: Days a usage record is kept: this month's bill and the two before.
RETENTION_DAYS = 93
RETENTION_S = RETENTION_DAYS * 86_400
#: Records one key's log holds in one partition at most (XADD MAXLEN ~): the oldest are trimmed first.
MAX_RECORDS = 500_000

RECORD_FIELDS = ("sid", "ts", "key", "model", "tier", "status", "reason", "max_tokens", "prompt_tokens",
                 "cached_tokens", "completion_tokens", "wasted_tokens", "compute_s", "queue_s", "ttft_ms")

#: The Lua that writes a generation's usage record, for the terminal events' scripts (broker.streams.scripts): in
#: its key's log of this partition (the log's name built from the stream's ``key_id`` and ``prefix``: same slot),
#: with the log trimmed to its bounds. What the stream's meta knows (key, tier, max_tokens, times, tokens a lost
#: attempt wasted) is read here; the rest is the ending attempt's. ``meta`` fields: ``started_at`` (ms of the first
#: claim) when the queue sets it, else ``claimed_at`` (s); ``wasted`` (tokens lost attempts reported:
#: broker.streams.store.Store.add_wasted).
RECORD_USAGE_LUA = SERVER_MS + f"""
local function record_usage(index, prefix, meta, sid, now_s, status, reason, model, prompt_tokens, cached_tokens,
                            completion_tokens, wasted_tokens, compute_s, ttft_ms)
  local m = redis.call('HMGET', meta, 'key_id', 'tier', 'max_tokens', 'created_at', 'started_at', 'claimed_at',
    'wasted')
  local key = m[1] or ''
  local log = prefix .. (key ~= '' and key or '-')
  local now = tonumber(now_s)
  local started = now
  if m[5] then started = tonumber(m[5]) / 1000 elseif m[6] then started = tonumber(m[6]) end
  local queue_s = ''
  if m[4] then queue_s = string.format('%.3f', math.max(0, started - tonumber(m[4]))) end
  local wasted = tonumber(wasted_tokens) + tonumber(m[7] or '0')
  local tier = (m[2] and m[2] ~= '') and m[2] or 'default'
  redis.call('XADD', log, 'MAXLEN', '~', {MAX_RECORDS}, '*', 'sid', sid, 'ts', now_s, 'key', key,
    'model', model or '', 'tier', tier, 'status', status, 'reason', reason, 'max_tokens', m[3] or '0',
    'prompt_tokens', prompt_tokens, 'cached_tokens', cached_tokens, 'completion_tokens', completion_tokens,
    'wasted_tokens', wasted, 'compute_s', compute_s, 'queue_s', queue_s, 'ttft_ms', ttft_ms)
  local now_ms = server_ms()
  redis.call('XTRIM', log, 'MINID', '~', string.format('%d', now_ms - {RETENTION_S * 1000}))
  redis.call('EXPIRE', log, {RETENTION_S})
  redis.call('ZADD', index, now_ms, key ~= '' and key or '-')
  redis.call('ZREMRANGEBYSCORE', index, '-inf', now_ms - {RETENTION_S * 1000})
end
"""

GROUP_BYS = ("key", "model", "day", "status", "reason", "tier")
COUNTERS = ("streams", "prompt_tokens", "cached_tokens", "completion_tokens", "wasted_tokens", "compute_s")
PRICED = ("cost_usd", "unpriced_streams")
#: What a usage report is rendered as (``format``, ``rsb report --usage --json|--csv``).
FORMATS = ("json", "csv")
_NAME = "(" + "|".join(GROUP_BYS) + ")"
#: What ``group_by`` may be (the API's document says the same).
GROUP_BY_PATTERN = f"^{_NAME}(,{_NAME})*$"
PAGE = 5000
_MAX_MS = 2**63 - 1
_PRICE_FIELDS = ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok")

Record = dict[str, str]


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens of one model (in one service tier)."""

    input_per_mtok: float
    cached_input_per_mtok: float
    output_per_mtok: float

    def cost_of(self, prompt: int, cached: int, completion: int) -> float:
        """What these tokens cost: the uncached prompt tokens, the cached ones and the completion."""
        cached = min(cached, prompt)
        return ((prompt - cached) * self.input_per_mtok + cached * self.cached_input_per_mtok
                + completion * self.output_per_mtok) / 1e6

    def cost(self, record: Record) -> float:
        """What a record's tokens cost. The tokens a lost attempt wasted are rsb's loss, not the caller's: not
        charged."""
        return self.cost_of(_int(record, "prompt_tokens"), _int(record, "cached_tokens"),
                            _int(record, "completion_tokens"))


class Prices:
    """``--prices FILE``: ``{"<model>": {"input_per_mtok": float, "cached_input_per_mtok": float,
    "output_per_mtok": float, "tiers"?: {"<tier>": {...the same fields}}}}`` (``cached_input_per_mtok`` defaults to
    the input price; a tier's fields each default to the model's own): a generation is priced at its model's
    price in the service tier it ran in (broker.tiers)."""

    def __init__(self, by_model: dict[str, Price], by_tier: dict[tuple[str, str], Price] | None = None) -> None:
        self.by_model = by_model
        self.by_tier = by_tier or {}

    @classmethod
    def parse(cls, raw: bytes, source: str = "prices") -> Prices:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"{source}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected an object of models, each {{{', '.join(_PRICE_FIELDS)}}}")
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

    def cost(self, record: Record) -> float | None:
        price = self.price(record.get("model", ""), record.get("tier") or DEFAULT_TIER)
        return None if price is None else price.cost(record)


def _price(entry: dict[str, Any], defaults: dict[str, Any], where: str) -> Price:
    values = {**defaults, **entry}
    for name in _PRICE_FIELDS:
        v = values.get(name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: {name} must be a number of USD, 0 or more")
    return Price(*(float(values[n]) for n in _PRICE_FIELDS))


def _int(record: Record, name: str) -> int:
    try:
        return int(record.get(name) or 0)
    except ValueError:
        return 0


def _float(record: Record, name: str) -> float:
    try:
        return float(record.get(name) or 0)
    except ValueError:
        return 0.0


def parse_group_by(raw: str | None, default: str = "key") -> tuple[str, ...]:
    """``key,model`` as group fields: names of GROUP_BYS, comma-separated (GROUP_BY_PATTERN); a repeated one counts
    once. None (not given): ``default``."""
    if raw is None:
        return (default,)
    if not re.fullmatch(GROUP_BY_PATTERN, raw):
        raise InvalidRequest(f"'group_by' is a comma-separated list of {', '.join(GROUP_BYS)}")
    return tuple(dict.fromkeys(raw.split(",")))


def id_range(since: float | None, until: float | None) -> tuple[str, str]:
    """The entry-id range of [since, until] (Unix seconds; None: open), clamped to what ids can hold."""
    lo = "-" if since is None else f"{min(max(0, int(since * 1000)), _MAX_MS)}-0"
    hi = "+" if until is None else f"{min(max(0, int(until * 1000)), _MAX_MS)}-{2**64 - 1}"
    return lo, hi


async def page_entries(redis: RedisClient, key: str, lo: str, hi: str) -> AsyncIterator[Record]:
    """Every entry of the Redis Stream ``key`` in [lo, hi], as text fields, a page at a time."""
    start = lo
    while True:
        entries: Any = await redis.xrange(key, min=start, max=hi, count=PAGE)
        for _, fields in entries:
            yield {reply_text(k): reply_text(v) for k, v in fields.items()}
        if len(entries) < PAGE:
            return
        start = "(" + reply_text(entries[-1][0])


async def records(redis: RedisClient, partitions: int, *, since: float | None = None, until: float | None = None,
                  key_id: str | None = None) -> AsyncIterator[Record]:
    """The usage records that ended in [since, until] and are within their retention: only ``key_id``'s when given
    ('' is the key of generations made without API keys), else every key's."""
    cutoff = time.time() - RETENTION_S
    lo, hi = id_range(since if since is not None and since > cutoff else cutoff, until)
    for p in range(partitions):
        if key_id is not None:
            keys = [key_id]
        else:
            raw: Any = await redis.zrange(usage_index_key(p, partitions), 0, -1)
            keys = ["" if reply_text(k) == "-" else reply_text(k) for k in raw]
        for key in keys:
            async for record in page_entries(redis, usage_log_key(p, partitions, key), lo, hi):
                yield record


def group_value(record: Record, name: str) -> str:
    if name == "day":
        return datetime.fromtimestamp(_float(record, "ts"), UTC).strftime("%Y-%m-%d")
    return record.get(name, "")


class Totals:
    """The counters of a group of records (and their cost, with prices)."""

    __slots__ = ("cost", "counts", "unpriced")

    def __init__(self) -> None:
        self.counts: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.cost = 0.0
        self.unpriced = 0

    def add(self, record: Record, prices: Prices | None) -> None:
        c = self.counts
        c["streams"] += 1
        for name in COUNTERS[1:-1]:
            c[name] += _int(record, name)
        c["compute_s"] += _float(record, "compute_s")
        if prices is not None:
            cost = prices.cost(record)
            if cost is None:
                self.unpriced += 1
            else:
                self.cost += cost

    def as_dict(self, priced: bool) -> dict[str, Any]:
        out: dict[str, Any] = {k: (round(v, 6) if k == "compute_s" else int(v)) for k, v in self.counts.items()}
        if priced:
            out["cost_usd"] = round(self.cost, 6)
            out["unpriced_streams"] = self.unpriced
        return out


async def usage_report(redis: RedisClient, partitions: int, *, since: float | None = None,
                       until: float | None = None, group_by: Sequence[str] = ("key",), key_id: str | None = None,
                       prices: Prices | None = None) -> dict[str, Any]:
    """``GET /v1/reports/usage``: the records in [since, until] (only ``key_id``'s when given), grouped."""
    groups: dict[tuple[str, ...], Totals] = {}
    total = Totals()
    async for record in records(redis, partitions, since=since, until=until, key_id=key_id):
        name = tuple(group_value(record, g) for g in group_by)
        acc = groups.get(name)
        if acc is None:
            acc = groups[name] = Totals()
        acc.add(record, prices)
        total.add(record, prices)
    priced = prices is not None
    rows = [{**dict(zip(group_by, name, strict=True)), **acc.as_dict(priced)} for name, acc in sorted(groups.items())]
    return {"group_by": list(group_by), "since": since, "until": until, "rows": rows, "total": total.as_dict(priced)}


def _columns(report: dict[str, Any]) -> list[str]:
    return [*COUNTERS, *(PRICED if "cost_usd" in report["total"] else ())]


def render_csv(report: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    groups, columns = list(report["group_by"]), _columns(report)
    w.writerow([*groups, *columns])
    rows: Iterable[dict[str, Any]] = report["rows"]
    for r in rows:
        w.writerow([*(r[g] for g in groups), *(r[c] for c in columns)])
    return buf.getvalue()


def render_table(report: dict[str, Any]) -> str:
    groups, columns = list(report["group_by"]), _columns(report)
    header = [*groups, *columns]
    rows = [[*(str(r[g]) or "-" for g in groups), *(_fmt(r[c]) for c in columns)] for r in report["rows"]]
    rows.append(["total", *([""] * (len(groups) - 1)), *(_fmt(report["total"][c]) for c in columns)])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:  # group columns left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if i < len(groups) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _fmt(v: float) -> str:
    return f"{v:.3f}" if isinstance(v, float) and not float(v).is_integer() else f"{int(v)}"
