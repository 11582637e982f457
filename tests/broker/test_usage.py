"""The usage ledger against a real redis-server: one record per generation that ended, written with its terminal
event (never twice: a finish retried, a zombie's finish, a cancel racing a claim), its fields, its bounds, and the
reports over it (usage grouped and priced; the aborted report as a view of it)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from broker.errors import InvalidRequest, OverStorageQuota
from broker.events import EventType
from broker.redis.connection import reply_text
from broker.redis.quota import NO_STORAGE_QUOTA, StorageQuota, storage_key
from broker.request.generation import GenerationRequest
from broker.streams import usage
from broker.streams import usage_report as ledger
from broker.streams.job_store import JobStore
from broker.streams.keys import aborted_log_key, usage_free_key, usage_index_key, usage_log_key
from broker.streams.records import Claim
from broker.streams.report import aborted_report
from broker.streams.stream_store import StreamStore
from broker.streams.usage import Prices
from broker.streams.usage_report import parse_group_by, usage_report

REQ = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), False)


async def _run(store: StreamStore, jobs: JobStore, key_id: str = "", *, status: str = "done", reason: str = "stop", prompt: int = 10,
               completion: int = 20, cached: int = 0, wasted: int = 0, tier: str = "default",
               quota: StorageQuota = NO_STORAGE_QUOTA) -> uuid.UUID:
    sid = uuid.uuid4()
    await store.create(sid, REQ, model="m", max_queue=0, retention_s=60, key_id=key_id, tier=tier, storage=quota)
    claim = await jobs.claim(sid, "w")
    assert isinstance(claim, Claim)
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached, "ttft_ms": 12.5,
         "tpot_ms": 1.0}
    etype = {"done": EventType.DONE, "cancelled": EventType.CANCELLED, "error": EventType.ERROR}[status]
    assert await jobs.finish(claim, etype, {"usage": u}, status=status, usage=u, model="demo", reason=reason,
                              compute_s=0.5, wasted_tokens=wasted) is not None
    return sid


async def _all(store: StreamStore, key_id: str | None = None) -> list[dict[str, str]]:
    return [r async for r in ledger.records(store.redis, 1, key_id=key_id)]


async def test_one_record_per_ended_generation_with_its_fields(store: StreamStore, jobs: JobStore) -> None:
    done = await _run(store, jobs, "alice", prompt=10, completion=20, cached=4)
    # A retried finish (its reply lost) and a zombie's finish write nothing more.
    sid = uuid.uuid4()
    await store.create(sid, REQ, model="m", max_queue=0, retention_s=60, key_id="bob")
    await store.redis.hset(store.keys(sid).meta, "tier", "priority")
    claim = await jobs.claim(sid, "w1")
    assert isinstance(claim, Claim)
    await jobs.add_wasted(claim, 7)  # an earlier attempt's refused tokens
    u = {"prompt_tokens": 5, "completion_tokens": 3, "cached_tokens": 0, "ttft_ms": None, "tpot_ms": None}
    for _ in range(2):
        assert await jobs.finish(claim, EventType.ERROR, {"code": "engine"}, status="error", usage=u, model="demo",
                                  reason="engine", compute_s=0.1, wasted_tokens=2) is not None
    await jobs.add_wasted(claim, 100)  # too late: the record is written
    queued = uuid.uuid4()
    await store.create(queued, REQ, model="asked", max_queue=0, retention_s=60, key_id="alice")
    await asyncio.sleep(0.05)  # deliberate: time in the queue, which its record counts (queue_s)
    assert await store.cancel(queued, "client") == "cancelled"
    assert await store.cancel(queued, "client") == "cancelled"  # nothing to cancel: no second record

    alice = await _all(store, "alice")
    assert [r["sid"] for r in alice] == [str(done), str(queued)]
    first = alice[0]
    assert (first["key"], first["model"], first["tier"], first["status"], first["reason"]) == (
        "alice", "demo", "default", "done", "stop")
    assert (first["prompt_tokens"], first["cached_tokens"], first["completion_tokens"], first["wasted_tokens"],
            first["max_tokens"], first["ttft_ms"]) == ("10", "4", "20", "0", "32", "12.500")
    assert float(first["compute_s"]) == 0.5 and 0 <= float(first["queue_s"]) < 5
    assert abs(float(first["ts"]) - time.time()) < 10
    cancelled = alice[1]
    assert (cancelled["status"], cancelled["reason"], cancelled["model"], cancelled["completion_tokens"]) == (
        "cancelled", "client", "asked", "0")
    assert float(cancelled["queue_s"]) >= 0.05  # it waited until its cancel
    [bob] = await _all(store, "bob")
    assert (bob["tier"], bob["status"], bob["reason"], bob["wasted_tokens"], bob["ttft_ms"]) == (
        "priority", "error", "engine", "9", "")
    assert len(await _all(store)) == 3
    assert set(await store.redis.zrange(usage_index_key(0, 1), 0, -1)) == {b"alice", b"bob"}


async def test_a_cancel_racing_a_claim_leaves_one_record(store: StreamStore, jobs: JobStore) -> None:
    for _ in range(20):
        sid = uuid.uuid4()
        await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
        claim, _ = await asyncio.gather(jobs.claim(sid, "w"), store.cancel(sid, "client"))
        if isinstance(claim, Claim):
            u = {"prompt_tokens": 1, "completion_tokens": 0}
            await jobs.finish(claim, EventType.CANCELLED, {}, status="cancelled", usage=u, reason="client")
        assert [r["sid"] for r in await _all(store)].count(str(sid)) == 1


async def test_the_report_groups_scopes_and_prices(store: StreamStore, jobs: JobStore) -> None:
    await _run(store, jobs, "alice", prompt=1_000_000, completion=500_000, cached=400_000)
    await _run(store, jobs, "alice", status="cancelled", reason="client", prompt=10, completion=5)
    await _run(store, jobs, "bob", status="error", reason="deadline", prompt=7, completion=3, wasted=11)
    prices = Prices.parse(b'{"demo": {"input_per_mtok": 2.0, "cached_input_per_mtok": 0.5, "output_per_mtok": 8.0}}')
    everyone = await usage_report(store.redis, 1, group_by=("key", "status"), prices=prices)
    rows = {(r["key"], r["status"]): r for r in everyone["rows"]}
    assert set(rows) == {("alice", "done"), ("alice", "cancelled"), ("bob", "error")}
    big = rows[("alice", "done")]
    assert big["cost_usd"] == pytest.approx(0.6 * 2.0 + 0.4 * 0.5 + 0.5 * 8.0)
    assert (big["streams"], big["prompt_tokens"], big["cached_tokens"], big["completion_tokens"]) == (
        1, 1_000_000, 400_000, 500_000)
    assert rows[("bob", "error")]["wasted_tokens"] == 11
    total = everyone["total"]
    assert total["streams"] == 3 and total["prompt_tokens"] == 1_000_017 and total["unpriced_streams"] == 0
    assert total["compute_s"] == pytest.approx(1.5)
    # One key's view: its own rows only. Unpriced models are counted apart, never priced at 0 in silence.
    mine = await usage_report(store.redis, 1, group_by=("model",), key_id="bob",
                              prices=Prices.parse(b'{"other": {"input_per_mtok": 1, "output_per_mtok": 1}}'))
    assert mine["rows"] == [{"model": "demo", **mine["total"]}]
    assert mine["total"]["streams"] == 1 and mine["total"]["unpriced_streams"] == 1 and mine["total"]["cost_usd"] == 0
    day = time.strftime("%Y-%m-%d", time.gmtime())
    by_day = await usage_report(store.redis, 1, group_by=("day", "tier"))
    assert [(r["day"], r["tier"], r["streams"]) for r in by_day["rows"]] == [(day, "default", 3)]
    assert "cost_usd" not in by_day["total"]
    assert (await usage_report(store.redis, 1, since=time.time() + 60))["total"]["streams"] == 0
    csv_text = ledger.render_csv(everyone)
    assert csv_text.splitlines()[0] == ("key,status,streams,prompt_tokens,cached_tokens,completion_tokens,"
                                        "wasted_tokens,compute_s,cost_usd,unpriced_streams")
    assert len(csv_text.splitlines()) == 4
    assert "total" in ledger.render_table(everyone)


async def test_prices_may_weight_tiers(store: StreamStore, jobs: JobStore) -> None:
    """``tiers`` in a model's price: a generation is priced in the tier it ran in; a tier's fields default to the
    model's own; an unlisted tier pays the model's price."""
    await _run(store, jobs, "alice", prompt=1_000_000, completion=1_000_000, tier="priority")
    await _run(store, jobs, "alice", prompt=1_000_000, completion=1_000_000, tier="flex")
    await _run(store, jobs, "alice", prompt=1_000_000, completion=1_000_000)
    prices = Prices.parse(b'{"demo": {"input_per_mtok": 1.0, "output_per_mtok": 4.0, "tiers": {'
                          b'"priority": {"input_per_mtok": 2.0, "output_per_mtok": 8.0}, "flex": {"output_per_mtok": 2}}}}')
    rows = {r["tier"]: r["cost_usd"] for r in (await usage_report(store.redis, 1, group_by=("tier",),
                                                                  prices=prices))["rows"]}
    assert rows == {"priority": pytest.approx(10.0), "flex": pytest.approx(3.0), "default": pytest.approx(5.0)}
    for raw in (b'{"m": {"input_per_mtok": 1, "output_per_mtok": 1, "tiers": {"scale": {}}}}',
                b'{"m": {"input_per_mtok": 1, "output_per_mtok": 1, "tiers": {"priority": {"extra": 1}}}}',
                b'{"m": {"input_per_mtok": 1, "output_per_mtok": 1, "tiers": {"priority": {"input_per_mtok": -1}}}}',
                b'{"m": {"input_per_mtok": 1, "output_per_mtok": 1, "tiers": []}}'):
        with pytest.raises(ValueError):
            Prices.parse(raw)


def test_group_by_and_prices_refuse_what_they_do_not_know() -> None:
    assert parse_group_by("key,model") == ("key", "model")
    assert parse_group_by("day,key,day") == ("day", "key")  # a repeated name counts once
    assert parse_group_by(None) == ("key",)
    for bad in ("key, model", "colour", "key;model", "key,", ",key", ""):
        with pytest.raises(InvalidRequest):
            parse_group_by(bad)
    for raw in (b"[]", b'{"m": {"input_per_mtok": -1, "output_per_mtok": 1}}', b'{"m": {"input_per_mtok": 1}}',
                b'{"m": {"input_per_mtok": 1, "output_per_mtok": 1, "extra": 2}}', b"nope",
                b'{"m": {"input_per_mtok": true, "output_per_mtok": 1}}'):
        with pytest.raises(ValueError):
            Prices.parse(raw)


async def test_the_aborted_report_is_a_view_of_the_ledger_and_of_the_old_log(store: StreamStore, jobs: JobStore) -> None:
    await _run(store, jobs, "alice")  # done: not aborted
    await _run(store, jobs, "alice", status="cancelled", reason="client", prompt=10, completion=5)
    await _run(store, jobs, "bob", status="error", reason="deadline", prompt=7, completion=3)
    # A record of the log the report read before the ledger (an upgrade keeps its figures).
    await store.redis.xadd(aborted_log_key(0, 1), {
        "sid": str(uuid.uuid4()), "ts": f"{time.time():.6f}", "status": "cancelled", "reason": "client",
        "model": "demo", "max_tokens": "32", "prompt_tokens": "2", "completion_tokens": "1", "tokens_saved": "31",
        "compute_s": "0.25", "key_id": "alice"})
    report = await aborted_report(store.redis, 1, group_by="reason")
    rows = {r["reason"]: r for r in report["rows"]}
    assert rows["client"] == {"reason": "client", "streams": 2, "prompt_tokens": 12, "completion_tokens": 6,
                              "tokens_saved": 27 + 31, "compute_s": 0.75}
    assert rows["deadline"]["tokens_saved"] == 29 and report["total"]["streams"] == 3
    alice = await aborted_report(store.redis, 1, group_by="model", key_id="alice")
    assert alice["total"]["streams"] == 2
    # Rendered by the one report engine, as `rsb report` prints it: its group, then its own counters.
    assert ledger.render_csv(report).splitlines()[0] == "reason,streams,prompt_tokens,completion_tokens,tokens_saved,compute_s"
    table = ledger.render_table(report).splitlines()
    assert table[0].split() == ["reason", "streams", "prompt_tokens", "completion_tokens", "tokens_saved", "compute_s"]
    assert table[-1].split()[:5] == ["total", "3", "19", "9", str(27 + 31 + 29)]


async def test_records_past_their_retention_are_neither_reported_nor_kept(store: StreamStore, jobs: JobStore) -> None:
    log = usage_log_key(0, 1, "alice")
    old_ms = int((time.time() - usage.RETENTION_S - 86_400) * 1000)
    await store.redis.xadd(log, {"sid": "old", "ts": str(old_ms / 1000), "status": "done"}, id=f"{old_ms}-0")
    await store.redis.zadd(usage_index_key(0, 1), {"alice": old_ms})
    assert await _all(store) == []  # listed, but past its retention
    await _run(store, jobs, "alice")
    assert [r["sid"] for r in await _all(store, "alice")] != ["old"]
    assert all(r["sid"] != "old" for r in await _all(store, "alice"))
    assert 0 < await store.redis.ttl(log) <= usage.RETENTION_S


async def _free(store: StreamStore, key_id: str, n: int) -> None:
    """``n`` free records: creates cancelled while queued (no token)."""
    async def one() -> None:
        sid = uuid.uuid4()
        await store.create(sid, REQ, model="m", max_queue=0, retention_s=60, key_id=key_id)
        await store.cancel(sid, "client")

    for i in range(0, n, 250):
        await asyncio.gather(*(one() for _ in range(min(250, n - i))))


async def _xranges(store: StreamStore) -> int:
    stats = await store.redis.info("commandstats")
    return int(stats.get("cmdstat_xrange", {}).get("calls", 0))


@pytest.mark.slow  # 11,000 creates and cancels
async def test_a_flood_of_free_records_leaves_every_billed_record(store: StreamStore, jobs: JobStore) -> None:
    """Issue 42: a key's log kept a fixed count of records, and create+cancel records cost nothing, so a flood of
    them pushed out all but 2 of 151 billed records. Billed records are kept by time only, apart."""
    billed = [await _run(store, jobs, "alice", prompt=100, completion=50) for _ in range(151)]
    await _free(store, "alice", usage.FREE_RECORDS + 1000)
    kept = {r["sid"] for r in await _all(store, "alice") if r["status"] == "done"}
    assert kept == {str(s) for s in billed}
    free_log = await store.redis.xlen(usage_free_key(0, 1, "alice"))
    assert usage.FREE_RECORDS <= free_log < usage.FREE_RECORDS + 1000  # capped (MAXLEN ~ trims whole nodes)
    # The report sums every record, trimmed free ones included, from the day's sums: it reads no record at all.
    before = await _xranges(store)
    report = await usage_report(store.redis, 1, group_by=("key", "status"))
    assert await _xranges(store) == before
    rows = {(r["key"], r["status"]): r for r in report["rows"]}
    assert rows[("alice", "done")]["streams"] == 151 and rows[("alice", "done")]["prompt_tokens"] == 15_100
    assert rows[("alice", "cancelled")]["streams"] == usage.FREE_RECORDS + 1000


async def test_billed_records_count_in_their_creators_storage_quota(store: StreamStore, jobs: JobStore) -> None:
    quota = StorageQuota("alice", 10 * usage.RECORD_BYTES + len(REQ.canonical_json()) - 1)
    for _ in range(10):
        await _run(store, jobs, "alice", quota=quota)
    await _free(store, "alice", 20)  # free records are bounded by count, not charged
    assert int(await store.redis.hget(storage_key(0, 1, "alice"), "bytes") or 0) == 10 * usage.RECORD_BYTES
    with pytest.raises(OverStorageQuota):  # the next request body does not fit beside the ledger
        await store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60, key_id="alice", storage=quota)
    # The charge leaves with the records: it expires when their day passes the retention.
    exp = await store.redis.zscore(storage_key(0, 1, "alice") + ":exp", f"usage:{int(time.time() // 86_400)}")
    assert exp is not None and abs(exp / 1000 - (time.time() // 86_400 + 1) * 86_400 - usage.RETENTION_S) < 5


async def test_records_from_before_the_day_sums_are_read_as_records(store: StreamStore, jobs: JobStore) -> None:
    """An upgraded ledger has records without day sums: their days are read as records, later days as sums."""
    yesterday_ms = int((time.time() - 86_400) * 1000)
    await store.redis.xadd(usage_log_key(0, 1, "alice"), {
        "sid": "old", "ts": str(yesterday_ms / 1000), "key": "alice", "model": "demo", "tier": "default",
        "status": "done", "reason": "stop", "max_tokens": "32", "prompt_tokens": "7", "cached_tokens": "0",
        "completion_tokens": "3", "wasted_tokens": "0", "compute_s": "0.1"}, id=f"{yesterday_ms}-0")
    await store.redis.zadd(usage_index_key(0, 1), {"alice": yesterday_ms})
    await _run(store, jobs, "alice", prompt=10, completion=20)
    report = await usage_report(store.redis, 1, group_by=("day",))
    assert [(r["streams"], r["prompt_tokens"]) for r in report["rows"]] == [(1, 7), (1, 10)]
    # Bounds inside a day read that part as records: only the newer record.
    assert (await usage_report(store.redis, 1, since=time.time() - 60))["total"]["streams"] == 1


async def test_queue_s_runs_from_the_create_to_the_first_claim_in_the_servers_time(store: StreamStore, jobs: JobStore) -> None:
    sid = uuid.uuid4()
    await store.create(sid, REQ, model="m", max_queue=0, retention_s=60, key_id="carol")
    meta = store.keys(sid).meta
    given_back = await jobs.claim(sid, "w0")
    assert isinstance(given_back, Claim)
    await jobs.give_back(given_back)  # claimed and not started: as if never claimed, its wait goes on
    assert await store.redis.hget(meta, "started_at") is None
    first = await jobs.claim(sid, "w1")
    assert isinstance(first, Claim)
    started = float(reply_text(await store.redis.hget(meta, "started_at")))
    second = await jobs.claim(sid, "w2")  # taken over: a later claim, the same start
    assert isinstance(second, Claim)
    created, claimed, started_again = (float(reply_text(v)) for v in
                                       await store.redis.hmget(meta, "created_at", "claimed_at", "started_at"))
    assert started_again == started and claimed >= started
    assert 0 <= second.waited_s == claimed - created  # both the server's: no pod clock in between
    u = {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0, "ttft_ms": None, "tpot_ms": None}
    assert await jobs.finish(second, EventType.DONE, {"usage": u}, status="done", usage=u, model="m") is not None
    [record] = await _all(store, "carol")
    assert record["queue_s"] == f"{started - created:.3f}"
    assert created <= float(record["ts"]) and abs(float(record["ts"]) - time.time()) < 10
