"""The aborted-generation report: what cancelled, abandoned and failed generations cost.

A view of the usage ledger (broker.streams.usage_report's rows): those whose status is not ``done``, with what each
saved (``max_tokens`` less the tokens it made). Records written before the ledger existed, in the partition's
aborted log (broker.streams.keys.aborted_log_key), are read too, so an upgrade changes no figure.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from broker.errors import InvalidRequest
from broker.redis.connection import RedisClient
from broker.streams import usage
from broker.streams import usage_report as ledger
from broker.streams.keys import aborted_log_key, aborted_totals_key

GROUP_BYS = ("reason", "model", "day")
COUNTERS = ("streams", "prompt_tokens", "completion_tokens", "tokens_saved", "compute_s")
_UNIX_SECONDS = re.compile(r"\A[0-9]{1,12}(\.[0-9]{1,9})?\Z")


def parse_time(raw: str | None, name: str) -> float | None:
    """Unix seconds or an ISO-8601 date/time (UTC if no zone)."""
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


def _key(record: dict[str, str], group_by: str) -> str:
    if group_by == "day":
        return datetime.fromtimestamp(float(record["ts"]), UTC).strftime("%Y-%m-%d")
    return record.get(group_by, "")


def _zero() -> dict[str, float]:
    return dict.fromkeys(COUNTERS, 0)


def _add(acc: dict[str, float], sums: dict[str, float]) -> None:
    for c in COUNTERS:
        acc[c] += sums.get(c, 0)


async def aborted_report(redis: RedisClient, partitions: int, *, since: float | None = None, until: float | None = None,
                         group_by: str = "reason", key_id: str | None = None,
                         retention_s: int = usage.RETENTION_S) -> dict[str, Any]:
    """Aggregate the aborted records in [since, until]; only ``key_id``'s when given (a tenant's view): the ledger's
    rows whose status is not done, then the old log's records."""
    if group_by not in GROUP_BYS:
        raise InvalidRequest(f"'group_by' must be one of {', '.join(GROUP_BYS)}")
    groups: dict[str, dict[str, float]] = {}
    total = _zero()
    async for row in ledger.rows(redis, partitions, since=since, until=until, key_id=key_id, retention_s=retention_s):
        if row.status == "done":
            continue
        _add(groups.setdefault(row.group(group_by), _zero()), row.sums)
        _add(total, row.sums)
    lo, hi = ledger.id_range(since, until)
    for p in range(partitions):
        async for _, record in ledger.page_entries(redis, aborted_log_key(p, partitions), lo, hi):
            if key_id is None or record.get("key_id", "") == key_id:
                sums = {"streams": 1, **{c: float(record.get(c) or 0) for c in COUNTERS[1:]}}
                _add(groups.setdefault(_key(record, group_by), _zero()), sums)
                _add(total, sums)
    rows = [{group_by: k, **_rounded(v)} for k, v in sorted(groups.items())]
    return {"group_by": group_by, "since": since, "until": until, "rows": rows, "total": _rounded(total)}


def _rounded(acc: dict[str, float]) -> dict[str, float]:
    return {k: (round(v, 6) if k == "compute_s" else int(v)) for k, v in acc.items()}


async def aborted_totals(redis: RedisClient, partitions: int) -> dict[tuple[str, str], float]:
    """Running totals by (reason, counter), for Prometheus counters."""
    out: dict[tuple[str, str], float] = {}
    for p in range(partitions):
        raw: Any = await redis.hgetall(aborted_totals_key(p, partitions))
        for field, value in raw.items():
            reason, _, counter = field.decode().partition("|")
            out[(reason, counter)] = out.get((reason, counter), 0.0) + float(value)
    return out


def render_table(report: dict[str, Any]) -> str:
    key = report["group_by"]
    header = [key, *COUNTERS]
    rows: list[list[str]] = [[str(r[key]), *(_fmt(r[c]) for c in COUNTERS)] for r in report["rows"]]
    rows.append(["total", *(_fmt(report["total"][c]) for c in COUNTERS)])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:  # the group column left-aligned, numbers right-aligned
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def render_csv(report: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([report["group_by"], *COUNTERS])
    rows: Iterable[dict[str, Any]] = report["rows"]
    for r in rows:
        w.writerow([r[report["group_by"]], *(r[c] for c in COUNTERS)])
    return buf.getvalue()


def _fmt(v: float) -> str:
    return f"{v:.3f}" if isinstance(v, float) and not float(v).is_integer() else f"{int(v)}"


