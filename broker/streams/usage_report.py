"""Reading the usage ledger (broker.streams.usage): its rows, and the one engine every report groups them with
(``grouped``): the usage report here (``GET /v1/reports/usage``, ``rsb report --usage``) and the aborted-generation
report (broker.streams.report), a view of the same rows.

A report reads each key's day sums for the whole UTC days its bounds cover (a few rows a day, whatever the number of
records) and the records themselves only for the part of a day a bound cuts (``since``/``until`` inside a day), and
for the days before the ledger kept sums (broker.streams.keys.usage_rollups_since_key). So a report with no bounds
reads sums only. Records past the retention are not reported.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from broker.errors import InvalidRequest
from broker.redis.connection import RedisClient, reply_text
from broker.redis.server_clock import server_now_s
from broker.request.tiers import DEFAULT as DEFAULT_TIER
from broker.streams.keys import (
    usage_day_key,
    usage_free_key,
    usage_index_key,
    usage_log_key,
    usage_rollups_since_key,
)
from broker.streams.usage import DAY_COUNTERS, DAY_S, RETENTION_S, Prices, Record

GROUP_BYS = ("key", "model", "day", "status", "reason", "tier")
#: What the usage report sums of each group (the aborted report sums its own: broker.streams.report.COUNTERS).
COUNTERS = ("streams", "prompt_tokens", "cached_tokens", "completion_tokens", "wasted_tokens", "compute_s")
#: What a usage report is rendered as (``format``, ``rsb report --usage --json|--csv``).
FORMATS = ("json", "csv")
_NAME = "(" + "|".join(GROUP_BYS) + ")"
#: What ``group_by`` may be (the API's document says the same).
GROUP_BY_PATTERN = f"^{_NAME}(,{_NAME})*$"
PAGE = 5000
_MAX_MS = 2**63 - 1
_UNIX_SECONDS = re.compile(r"\A[0-9]{1,12}(\.[0-9]{1,9})?\Z")


@dataclass(slots=True)
class Row:
    """Sums of a key's records of one day with one model, tier, status and reason (DAY_COUNTERS)."""

    key: str
    day: int  # days since the epoch (UTC)
    model: str
    tier: str
    status: str
    reason: str
    sums: dict[str, float]

    def group(self, name: str) -> str:
        if name == "day":
            return datetime.fromtimestamp(self.day * DAY_S, UTC).strftime("%Y-%m-%d")
        return str(getattr(self, name))


def parse_time(raw: str | None, name: str) -> float | None:
    """A report's bound (``since``, ``until``): Unix seconds or an ISO-8601 date/time (UTC if no zone)."""
    if raw is None or raw == "":
        return None
    if _UNIX_SECONDS.match(raw):
        return float(raw)
    try:
        dt = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"'{name}' must be unix seconds or an ISO-8601 time") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


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


async def page_entries(redis: RedisClient, key: str, lo: str, hi: str) -> AsyncIterator[tuple[str, Record]]:
    """Every entry of the Redis Stream ``key`` in [lo, hi], its id and its fields as text, a page at a time."""
    start = lo
    while True:
        entries: Any = await redis.xrange(key, min=start, max=hi, count=PAGE)
        for eid, fields in entries:
            yield reply_text(eid), {reply_text(k): reply_text(v) for k, v in fields.items()}
        if len(entries) < PAGE:
            return
        start = "(" + reply_text(entries[-1][0])


async def _keys(redis: RedisClient, partition: int, partitions: int, key_id: str | None) -> list[str]:
    if key_id is not None:
        return [key_id]
    raw: Any = await redis.zrange(usage_index_key(partition, partitions), 0, -1)
    return ["" if reply_text(k) == "-" else reply_text(k) for k in raw]


async def records(redis: RedisClient, partitions: int, *, since: float | None = None, until: float | None = None,
                  key_id: str | None = None, retention_s: int = RETENTION_S) -> AsyncIterator[Record]:
    """The usage records (billed and free, in the order they ended) that ended in [since, until] and are within
    their retention: only ``key_id``'s when given ('' is the key of generations made without API keys), else
    every key's."""
    # The server's time, which the ledger's ids and days are in, read now (a report is rare and its edge exact).
    cutoff = await server_now_s(redis, partitions) - retention_s
    lo, hi = id_range(since if since is not None and since > cutoff else cutoff, until)
    for p in range(partitions):
        for key in await _keys(redis, p, partitions, key_id):
            both = [(eid, r) async for eid, r in page_entries(redis, usage_log_key(p, partitions, key), lo, hi)]
            both += [(eid, r) async for eid, r in page_entries(redis, usage_free_key(p, partitions, key), lo, hi)]
            for _, record in sorted(both, key=lambda e: tuple(int(x) for x in e[0].split("-"))):
                yield record


def _record_row(key: str, eid: str, record: Record) -> Row:
    sums: dict[str, float] = {"streams": 1}
    for name in DAY_COUNTERS[1:-2]:
        sums[name] = _int(record, name)
    sums["tokens_saved"] = max(0, _int(record, "max_tokens") - _int(record, "completion_tokens"))
    sums["compute_s"] = number(record, "compute_s")
    return Row(key, int(eid.split("-")[0]) // (DAY_S * 1000), record.get("model", ""),
               record.get("tier") or DEFAULT_TIER, record.get("status", ""), record.get("reason", ""), sums)


async def rows(redis: RedisClient, partitions: int, *, since: float | None = None, until: float | None = None,
               key_id: str | None = None, retention_s: int = RETENTION_S) -> AsyncIterator[Row]:
    """The ledger's rows for [since, until] (Unix s; None: open), only ``key_id``'s when given: a day's sums for each
    whole day in range, a row per record for the part of a day a bound cuts (see the module doc)."""
    now = await server_now_s(redis, partitions)
    cutoff = now - retention_s
    lo = since if since is not None and since > cutoff else None
    first = math.floor((lo if lo is not None else cutoff) / DAY_S)
    last = math.floor((until if until is not None else now) / DAY_S)
    for p in range(partitions):
        raw_since: Any = await redis.get(usage_rollups_since_key(p, partitions))
        summed_after = int(raw_since) if raw_since is not None else last
        for key in await _keys(redis, p, partitions, key_id):
            whole: list[int] = []
            for day in range(first, last + 1):
                start, end = day * DAY_S, (day + 1) * DAY_S
                cut = (lo is not None and lo > start) or (until is not None and until < end - 0.001)
                if not cut and day > summed_after:
                    whole.append(day)
                    continue
                a, b = id_range(max(start, lo) if lo is not None else start, min(end - 0.001, until)
                                if until is not None else end - 0.001)
                for log in (usage_log_key(p, partitions, key), usage_free_key(p, partitions, key)):
                    async for eid, record in page_entries(redis, log, a, b):
                        yield _record_row(key, eid, record)
            for day, sums in zip(whole, await _day_sums(redis, [usage_day_key(p, partitions, key, d) for d in whole]),
                                 strict=True):
                for (model, tier, status, reason), counters in sums.items():
                    yield Row(key, day, model, tier, status, reason, counters)


async def _day_sums(redis: RedisClient, keys: list[str]) -> list[dict[tuple[str, str, str, str], dict[str, float]]]:
    """Each day hash's rows: (model, tier, status, reason) to its sums, read in one pipeline."""
    if not keys:
        return []
    pipe = redis.pipeline(transaction=False)
    for k in keys:
        pipe.hgetall(k)
    out = []
    for raw in await pipe.execute():
        day: dict[tuple[str, str, str, str], dict[str, float]] = {}
        for field, value in raw.items():
            counter, _, group = reply_text(field).partition(" ")
            model, tier, status, reason = orjson.loads(group)
            day.setdefault((model, tier, status, reason), dict.fromkeys(DAY_COUNTERS, 0.0))[counter] = float(value)
        out.append(day)
    return out


class Totals:
    """The ``counters`` of a group of rows (and their cost, with prices)."""

    __slots__ = ("cost", "counts", "unpriced")

    def __init__(self, counters: Sequence[str]) -> None:
        self.counts: dict[str, float] = dict.fromkeys(counters, 0)
        self.cost = 0.0
        self.unpriced = 0

    def add(self, row: Row, prices: Prices | None) -> None:
        for name in self.counts:
            self.counts[name] += row.sums.get(name, 0)
        if prices is not None:
            price = prices.price(row.model, row.tier)
            if price is None:
                self.unpriced += int(row.sums.get("streams", 0))
            else:
                s = row.sums
                self.cost += price.cost_of(int(s["prompt_tokens"]), int(s["cached_tokens"]),
                                           int(s["completion_tokens"]))

    def as_dict(self, priced: bool) -> dict[str, Any]:
        out: dict[str, Any] = {k: (round(v, 6) if k == "compute_s" else int(v)) for k, v in self.counts.items()}
        if priced:
            out["cost_usd"] = round(self.cost, 6)
            out["unpriced_streams"] = self.unpriced
        return out


async def grouped(rows_: AsyncIterable[Row], group_by: Sequence[str], counters: Sequence[str],
                  prices: Prices | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every report's grouping: ``rows_`` summed by the fields ``group_by`` names (Row.group), each group's
    ``counters`` (and, with ``prices``, their cost), one dict per group in the order of its names; and the total."""
    groups: dict[tuple[str, ...], Totals] = {}
    total = Totals(counters)
    async for row in rows_:
        name = tuple(row.group(g) for g in group_by)
        acc = groups.get(name)
        if acc is None:
            acc = groups[name] = Totals(counters)
        acc.add(row, prices)
        total.add(row, prices)
    priced = prices is not None
    out = [{**dict(zip(group_by, name, strict=True)), **acc.as_dict(priced)} for name, acc in sorted(groups.items())]
    return out, total.as_dict(priced)


async def usage_report(redis: RedisClient, partitions: int, *, since: float | None = None,
                       until: float | None = None, group_by: Sequence[str] = ("key",), key_id: str | None = None,
                       prices: Prices | None = None, retention_s: int = RETENTION_S) -> dict[str, Any]:
    """``GET /v1/reports/usage``: the ledger's rows in [since, until] (only ``key_id``'s when given), grouped."""
    found = rows(redis, partitions, since=since, until=until, key_id=key_id, retention_s=retention_s)
    out, total = await grouped(found, group_by, COUNTERS, prices)
    return {"group_by": list(group_by), "since": since, "until": until, "rows": out, "total": total}


def _int(record: Record, name: str) -> int:
    try:
        return int(record.get(name) or 0)
    except ValueError:
        return 0


def number(record: Record, name: str) -> float:
    """A record's field as a number (0 when absent or not one)."""
    try:
        return float(record.get(name) or 0)
    except ValueError:
        return 0.0


def _layout(report: dict[str, Any]) -> tuple[list[str], list[str]]:
    """A report's group fields (a list, or the aborted report's one name) and its columns (its total's, in order)."""
    groups = report["group_by"]
    return ([groups] if isinstance(groups, str) else list(groups)), list(report["total"])


def render_csv(report: dict[str, Any]) -> str:
    """A report (usage or aborted) as CSV: its group fields, then its counters."""
    buf = io.StringIO()
    w = csv.writer(buf)
    groups, columns = _layout(report)
    w.writerow([*groups, *columns])
    rows_: Iterable[dict[str, Any]] = report["rows"]
    for r in rows_:
        w.writerow([*(r[g] for g in groups), *(r[c] for c in columns)])
    return buf.getvalue()


def render_table(report: dict[str, Any]) -> str:
    """A report (usage or aborted) as a table for a terminal, its total last."""
    groups, columns = _layout(report)
    header = [*groups, *columns]
    body = [[*(str(r[g]) or "-" for g in groups), *(_fmt(r[c]) for c in columns)] for r in report["rows"]]
    body.append(["total", *([""] * (len(groups) - 1)), *(_fmt(report["total"][c]) for c in columns)])
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:  # group columns left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if i < len(groups) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in body)])


def _fmt(v: float) -> str:
    return f"{v:.3f}" if isinstance(v, float) and not float(v).is_integer() else f"{int(v)}"
