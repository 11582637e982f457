"""The aborted-generation report: what cancelled, abandoned and failed generations cost.

A view of the usage ledger, through the one report engine (broker.streams.usage_report.grouped): the ledger's rows
whose status is not ``done``, summed as COUNTERS, with what each saved (``tokens_saved``: ``max_tokens`` less the
tokens it made). Records written before the ledger existed, in the partition's aborted log
(broker.streams.keys.aborted_log_key), are rows of it too, so an upgrade changes no figure.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

from broker.errors import InvalidRequest
from broker.redis.connection import RedisClient
from broker.request.tiers import DEFAULT as DEFAULT_TIER
from broker.streams import usage
from broker.streams import usage_report as ledger
from broker.streams.keys import aborted_log_key, aborted_totals_key

GROUP_BYS = ("reason", "model", "day")
COUNTERS = ("streams", "prompt_tokens", "completion_tokens", "tokens_saved", "compute_s")


async def aborted_report(redis: RedisClient, partitions: int, *, since: float | None = None, until: float | None = None,
                         group_by: str = "reason", key_id: str | None = None,
                         retention_s: int = usage.RETENTION_S) -> dict[str, Any]:
    """Aggregate the aborted generations that ended in [since, until]; only ``key_id``'s when given (a tenant's
    view)."""
    if group_by not in GROUP_BYS:
        raise InvalidRequest(f"'group_by' must be one of {', '.join(GROUP_BYS)}")
    found = _aborted_rows(redis, partitions, since=since, until=until, key_id=key_id, retention_s=retention_s)
    rows, total = await ledger.grouped(found, (group_by,), COUNTERS)
    return {"group_by": group_by, "since": since, "until": until, "rows": rows, "total": total}


async def _aborted_rows(redis: RedisClient, partitions: int, *, since: float | None, until: float | None,
                        key_id: str | None, retention_s: int) -> AsyncIterator[ledger.Row]:
    """The ledger's rows whose status is not done, then the old log's records as rows."""
    async for row in ledger.rows(redis, partitions, since=since, until=until, key_id=key_id, retention_s=retention_s):
        if row.status != "done":
            yield row
    lo, hi = ledger.id_range(since, until)
    for p in range(partitions):
        async for _, record in ledger.page_entries(redis, aborted_log_key(p, partitions), lo, hi):
            if key_id is None or record.get("key_id", "") == key_id:
                yield _old_row(record)


def _old_row(record: usage.Record) -> ledger.Row:
    """A record of the aborted log the ledger replaced (its fields: ts, reason, model, key_id and the counters)."""
    sums = {"streams": 1.0, **{c: ledger.number(record, c) for c in COUNTERS[1:]}}
    day = math.floor(ledger.number(record, "ts") / usage.DAY_S)
    return ledger.Row(record.get("key_id", ""), day, record.get("model", ""), DEFAULT_TIER, "",
                      record.get("reason", ""), sums)


async def aborted_totals(redis: RedisClient, partitions: int) -> dict[tuple[str, str], float]:
    """Running totals by (reason, counter), for Prometheus counters."""
    out: dict[tuple[str, str], float] = {}
    for p in range(partitions):
        raw: Any = await redis.hgetall(aborted_totals_key(p, partitions))
        for field, value in raw.items():
            reason, _, counter = field.decode().partition("|")
            out[(reason, counter)] = out.get((reason, counter), 0.0) + float(value)
    return out
