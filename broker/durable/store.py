"""Durable Streams in Redis (the open protocol served by consumer/views/durable): the only module that talks
to Redis about them. Every change is one script of broker.durable.scripts; reads of immutable history (a
fork's copy) are plain XRANGEs.

A Durable Stream is named by its client (a URL path) within its API key's namespace (broker.durable.keys
``DurableKeys``); its offsets and stored forms are broker.durable.format's. Forks are copied at creation (the
protocol allows any mechanism): a fork lives in its own name's slot, and a copy makes it an ordinary stream for
reads, live modes, TTL and producers, so no read ever spans two slots. Its source keeps a reference (the fork's
name in its ``forks`` set) so that deleting the source only soft-deletes it (410) until its last fork goes.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from broker.durable import scripts
from broker.durable.format import JSON_TYPE, ZERO_ID, encode_json, json_array, normalize_content_type
from broker.durable.keys import DurableKeys
from broker.errors import Conflict, Expired, InvalidRequest, NotFound, OverStorageQuota, PayloadTooLarge, TooManyStreams
from broker.redis.connection import RedisClient, register_script, reply_text
from broker.redis.lua import Lua
from broker.redis.quota import NO_STORAGE_QUOTA, StorageQuota, storage_key

#: What each stored message costs against a stream's size cap besides its bytes (Redis's bookkeeping per entry).
ENTRY_CHARGE = 64
# Entries per XRANGE while copying a fork's inherited history.
COPY_PAGE = 1000
# Forks a visit of a soft-deleted stream checks for having gone away by expiry (bounds the visit's work).
PRUNE_MAX = 64


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """What a PUT asks for. ``content_type``: as given, '' for a fork that inherits its source's."""

    content_type: str
    ttl_s: int | None = None
    expires_at: str | None = None
    expires_ms: int | None = None
    closed: bool = False


@dataclass(frozen=True, slots=True)
class ForkSpec:
    source: DurableKeys
    offset: str | None = None  # an entry id; None: the source's tail
    sub_offset: int = 0


@dataclass(frozen=True, slots=True)
class DurableCreated:
    created: bool  # False: the same PUT again (idempotent)
    tail: str
    content_type: str
    closed: bool


class Outcome(StrEnum):
    """What an append (or close) came to; the view turns each into its status and headers."""

    OK = "ok"
    DUPLICATE = "dup"  # a producer's retry of a request that already landed
    DUPLICATE_CLOSE = "dup_closed"  # a producer's retry of the request that closed the stream
    ALREADY_CLOSED = "closed_ok"  # a close-only request on a closed stream
    CLOSED = "closed"
    TYPE_MISMATCH = "ct_mismatch"
    STALE_EPOCH = "stale"
    BAD_EPOCH = "bad_epoch"
    SEQUENCE_GAP = "gap"
    SEQ_CONFLICT = "seq_conflict"
    BAD_BODY = "bad_body"
    TOO_BIG = "too_big"


@dataclass(frozen=True, slots=True)
class Producer:
    id: str
    epoch: int
    seq: int


@dataclass(frozen=True, slots=True)
class Appended:
    outcome: Outcome
    tail: str = ZERO_ID
    epoch: str = ""  # the producer epoch to report (stale: the current one)
    seq: str = ""  # the highest accepted producer seq (duplicate)
    expected_seq: str = ""
    received_seq: str = ""


@dataclass(frozen=True, slots=True)
class Page:
    """One read: entries after ``after`` from one snapshot of the stream."""

    tail: str
    closed: bool
    content_type: str
    json: bool
    gen: str
    after: str
    more: bool  # cut short by the page limits: read on from ``next_id``
    entries: list[tuple[str, bytes]]
    ttl_s: int = 0  # the stream's sliding TTL (0: none)

    @property
    def next_id(self) -> str:
        return self.entries[-1][0] if self.more else self.tail

    @property
    def up_to_date(self) -> bool:
        return not self.more

    @property
    def closed_here(self) -> bool:
        """The stream is closed and this page reaches its final offset."""
        return self.closed and not self.more

    def body(self) -> bytes:
        stored = (b for _, b in self.entries)
        return json_array(stored) if self.json else b"".join(stored)


@dataclass(frozen=True, slots=True)
class Meta:
    content_type: str
    tail: str
    closed: bool
    ttl_s: str
    expires_at: str


class DurableStore:
    """Holds no state beyond the client and the registered scripts; works unchanged on Redis Cluster."""

    def __init__(self, redis: RedisClient, partitions: int = 1) -> None:
        self.redis = redis
        self.partitions = partitions
        def register(script: Lua) -> Any:
            return register_script(redis, script.text)

        self._create = register(scripts.CREATE)
        self._append = register(scripts.APPEND)
        self._read = register(scripts.READ)
        self._delete = register(scripts.DELETE)
        self._unref = register(scripts.UNREF)
        self._fork_ref = register(scripts.FORK_REF)

    def keys(self, key_id: str, path: str) -> DurableKeys:
        return DurableKeys.of(key_id, path, self.partitions)

    # -- create ---------------------------------------------------------------------------------------

    async def create(self, keys: DurableKeys, spec: StreamSpec, body: bytes, *, fork: ForkSpec | None = None,
                     max_streams: int = 0, max_bytes: int = 0,
                     quota: StorageQuota = NO_STORAGE_QUOTA) -> DurableCreated:
        """Create the stream (or recognise the same PUT again), charged to ``quota``'s caller (a fork at its full
        size). Raises Conflict (another configuration, a soft-deleted path or source, a fork's type mismatch),
        NotFound (fork source), InvalidRequest (body, fork offsets), PayloadTooLarge, TooManyStreams,
        StorageQuota."""
        if fork is not None:
            return await self._fork(keys, spec, body, fork, max_streams, max_bytes, quota)
        ctn = normalize_content_type(spec.content_type)
        stored = self._initial(body, ctn == JSON_TYPE)
        size = len(stored) + ENTRY_CHARGE if stored else 0
        if max_bytes and size > max_bytes:
            raise PayloadTooLarge(f"the initial data exceeds the stream size limit ({max_bytes} bytes)")
        entries = [("", stored)] if stored else []
        res = await self._create_call(keys, spec, ctn, ctn, entries, size=size, max_streams=max_streams, quota=quota)
        return self._created(res, spec, quota, self.partitions)

    @staticmethod
    def _initial(body: bytes, is_json: bool) -> bytes:
        if not body or not is_json:
            return body
        stored = encode_json(body, allow_empty=True)
        if stored is None:
            raise InvalidRequest("the body is not valid JSON")
        return stored

    async def _create_call(self, keys: DurableKeys, spec: StreamSpec, ctn: str, ctn_match: str,
                           entries: Sequence[tuple[str, bytes]], *, size: int = 0, max_streams: int = 0,
                           fork: ForkSpec | None = None, fork_offset: str = "", inherit: bool = False,
                           ttl_s: int | None = None, expires: tuple[str, str] = ("", ""),
                           content_type: str | None = None, probe: bool = False,
                           quota: StorageQuota = NO_STORAGE_QUOTA) -> list[Any]:
        ttl = spec.ttl_s if ttl_s is None else ttl_s
        exp, expms = (spec.expires_at or "", str(spec.expires_ms or "")) if not expires[0] else expires
        script = scripts.CREATE
        args = script.args({
            "name": keys.name, "ct": spec.content_type if content_type is None else content_type, "ctn": ctn,
            "ctn_match": ctn_match, "ttl": "" if ttl is None else str(ttl), "exp": exp, "expms": expms,
            "inherit": int(inherit), "closed": int(spec.closed), "from": fork.source.name if fork else "",
            "fork_offset": fork_offset, "offset_given": int(bool(fork and fork.offset)),
            "sub_offset": fork.sub_offset if fork else 0, "gen": secrets.token_hex(6), "probe": int(probe),
            "max_streams": max_streams, "size": size, "json": int(ctn == JSON_TYPE),
            "storage_share": quota.share(self.partitions)},
            *(part for entry in entries for part in entry))
        storage = storage_key(keys.partition, self.partitions, quota.tenant)
        res: list[Any] = await self._create(keys=script.keys({**keys.script_keys, "storage": storage}), args=args)
        return res

    @staticmethod
    def _created(res: list[Any], spec: StreamSpec, quota: StorageQuota = NO_STORAGE_QUOTA,
                 partitions: int = 1) -> DurableCreated:
        tag = reply_text(res[0])
        if tag == "created":
            return DurableCreated(True, reply_text(res[1]), spec.content_type, spec.closed)
        if tag == "exists":
            return DurableCreated(False, reply_text(res[2]), reply_text(res[3]), reply_text(res[4]) == "1")
        if tag == "soft":
            raise Conflict("this stream was deleted but forks still reference it: the path cannot be reused yet")
        if tag == "limit":
            raise TooManyStreams("this API key holds as many durable streams as it may")
        if tag == "quota":
            raise OverStorageQuota(quota.quota_bytes, partitions, quota.share(partitions))
        raise Conflict("a stream exists at this path with a different configuration")

    async def _fork(self, keys: DurableKeys, spec: StreamSpec, body: bytes, fork: ForkSpec, max_streams: int,
                    max_bytes: int, quota: StorageQuota) -> DurableCreated:
        ctn_given = normalize_content_type(spec.content_type) if spec.content_type else ""
        inherit = spec.ttl_s is None and spec.expires_at is None
        fork_offset = fork.offset or ""
        # The same PUT again is answered without touching the source (and without taking a reference).
        probe = await self._create_call(keys, spec, ctn_given, ctn_given, [], fork=fork, fork_offset=fork_offset,
                                        inherit=inherit, probe=True, quota=quota)
        if reply_text(probe[0]) != "absent":
            return self._created(probe, spec)
        src = fork.source
        ref = await self._fork_ref(
            keys=scripts.FORK_REF.keys({"meta": src.meta, "data": src.data, "forks": src.forks}),
            args=scripts.FORK_REF.args({"fork": keys.name, "ctn": ctn_given, "fork_offset": fork_offset,
                                        "sub_offset": fork.sub_offset}))
        tag = reply_text(ref[0])
        if tag == "notfound":
            raise NotFound("the fork's source stream does not exist")
        if tag == "soft":
            raise Conflict("the fork's source stream was deleted (it still has forks)")
        if tag == "ct":
            raise Conflict("the fork's content type differs from its source's")
        if tag == "offset":
            raise InvalidRequest("Stream-Fork-Offset is beyond the source stream's tail")
        if tag == "sub":
            raise InvalidRequest("Stream-Fork-Sub-Offset: the source has no data after the fork offset")
        offset, ct, ctn, is_json, ttl, exp, expms, gen = (reply_text(v) for v in ref[1:9])
        next_entry: bytes = ref[9]
        try:
            copies, size = await self._copy(src, offset, gen, max_bytes)
            entries: list[tuple[str, bytes]] = list(copies)
            if fork.sub_offset:
                prefix = self._sub_offset_prefix(next_entry, fork.sub_offset, is_json == "1")
                entries.append(("", prefix))
                size += len(prefix) + ENTRY_CHARGE
            stored = self._initial(body, is_json == "1")
            if stored:
                entries.append(("", stored))
                size += len(stored) + ENTRY_CHARGE
            if max_bytes and size > max_bytes:
                raise PayloadTooLarge(f"the fork exceeds the stream size limit ({max_bytes} bytes)")
            own = not inherit
            res = await self._create_call(
                keys, spec, ctn, ctn_given, entries, size=size, max_streams=max_streams, fork=fork,
                fork_offset=offset, inherit=inherit, content_type=spec.content_type or ct,
                ttl_s=spec.ttl_s if own else (int(ttl) if ttl else None),
                expires=("", "") if own or ttl else (exp, expms), quota=quota)
        except BaseException:
            await self._release(src, keys.name)
            raise
        # Another PUT of this path won a race: the reference stays only if that stream is a fork of this source.
        if reply_text(res[0]) != "created" and reply_text(res[1]) != src.name:
            await self._release(src, keys.name)
        return self._created(res, StreamSpec(spec.content_type or ct, spec.ttl_s, spec.expires_at,
                                             spec.expires_ms, spec.closed), quota, self.partitions)

    async def _copy(self, src: DurableKeys, upto: str, gen: str, max_bytes: int) -> tuple[list[tuple[str, bytes]], int]:
        """The source's entries up to ``upto``. History up to an offset never changes while the stream lives, so
        paging outside a script is safe, provided it is still the same stream afterwards (``gen``)."""
        out: list[tuple[str, bytes]] = []
        size, start = 0, "-"
        while True:
            page: Any = await self.redis.xrange(src.data, min=start, max=upto, count=COPY_PAGE)
            for entry_id, fields in page:
                data = fields[b"b"]
                out.append((reply_text(entry_id), data))
                size += len(data) + ENTRY_CHARGE
            if max_bytes and size > max_bytes:
                raise PayloadTooLarge(f"the fork exceeds the stream size limit ({max_bytes} bytes)")
            if len(page) < COPY_PAGE:
                break
            start = "(" + out[-1][0]
        if reply_text(await self.redis.hget(src.meta, "gen")) != gen:
            raise NotFound("the fork's source stream went away while it was copied")
        return out, size

    @staticmethod
    def _sub_offset_prefix(entry: bytes, n: int, is_json: bool) -> bytes:
        """The first ``n`` units of the message after the fork offset: items in JSON mode, else bytes."""
        if is_json:
            items = entry.split(b"\n")
            if n > len(items):
                raise InvalidRequest("Stream-Fork-Sub-Offset is beyond the message's item count")
            return b"\n".join(items[:n])
        if n > len(entry):
            raise InvalidRequest("Stream-Fork-Sub-Offset is beyond the message's length")
        return entry[:n]

    # -- append, close ----------------------------------------------------------------------------------

    async def append(self, keys: DurableKeys, body: bytes, content_type: str, *, close: bool = False,
                     stream_seq: str = "", producer: Producer | None = None, max_bytes: int = 0,
                     quota: StorageQuota = NO_STORAGE_QUOTA) -> Appended:
        """Append ``body`` (empty: close-only) and/or close, charged to the stream's creator with ``quota``'s bound.
        Raises NotFound, Expired (soft-deleted), StorageQuota."""
        ctn = normalize_content_type(content_type)
        stored, valid = body, True
        if body and ctn == JSON_TYPE:
            encoded = encode_json(body, allow_empty=False)
            stored, valid = (body, False) if encoded is None else (encoded, True)
        res = await self._append(keys=scripts.APPEND.keys(keys.script_keys), args=scripts.APPEND.args({
            "channel": keys.channel, "body": stored, "ctn": ctn, "close": int(close), "stream_seq": stream_seq,
            "producer": producer.id if producer else "", "epoch": producer.epoch if producer else 0,
            "seq": producer.seq if producer else 0, "valid": int(valid), "max_size": max_bytes,
            "charge": len(stored) + ENTRY_CHARGE, "storage_share": quota.share(self.partitions)}))
        tag = reply_text(res[0])
        if tag == "notfound":
            raise NotFound("no stream at this path")
        if tag == "quota":
            raise OverStorageQuota(quota.quota_bytes, self.partitions, quota.share(self.partitions))
        if tag == "gone":
            raise await self._gone(keys)
        outcome = Outcome(tag)
        vals = [reply_text(v) for v in res[1:]]
        if outcome in (Outcome.OK, Outcome.DUPLICATE_CLOSE, Outcome.ALREADY_CLOSED, Outcome.CLOSED,
                       Outcome.TYPE_MISMATCH):
            return Appended(outcome, tail=vals[0])
        if outcome is Outcome.DUPLICATE:
            return Appended(outcome, seq=vals[0], tail=vals[1])
        if outcome is Outcome.STALE_EPOCH:
            return Appended(outcome, epoch=vals[0])
        if outcome is Outcome.SEQUENCE_GAP:
            return Appended(outcome, expected_seq=vals[0], received_seq=vals[1])
        return Appended(outcome)

    # -- read -------------------------------------------------------------------------------------------

    async def read(self, keys: DurableKeys, after: str, *, count: int, max_bytes: int, refresh: bool = True) -> Page:
        """Entries after ``after`` (an entry id, ``-1`` or ``now``), at most ``count`` and about ``max_bytes``
        (never fewer than one). ``refresh``: this read restarts a sliding TTL. Raises NotFound, Expired."""
        res = await self._read(keys=scripts.READ.keys(keys.script_keys), args=scripts.READ.args(
            {"after": after, "count": count, "max_bytes": max_bytes, "refresh": int(refresh)}))
        tag = reply_text(res[0])
        if tag == "notfound":
            raise NotFound("no stream at this path")
        if tag == "gone":
            raise await self._gone(keys)
        tail, closed, ct, is_json, gen, start, more, ttl = (reply_text(v) for v in res[1:9])
        entries = [(reply_text(res[i]), bytes(res[i + 1])) for i in range(9, len(res), 2)]
        return Page(tail, closed == "1", ct, is_json == "1", gen, start, more == "1", entries, int(ttl or 0))

    async def head(self, keys: DurableKeys) -> Meta:
        """The stream's metadata; restarts no TTL. Raises NotFound, Expired."""
        raw = await self.redis.hmget(keys.meta, ["ct", "tail", "closed", "ttl", "exp", "soft"])
        if raw[1] is None:
            raise NotFound("no stream at this path")
        if reply_text(raw[5]) == "1":
            raise await self._gone(keys)
        return Meta(reply_text(raw[0]), reply_text(raw[1]), reply_text(raw[2]) == "1", reply_text(raw[3]),
                    reply_text(raw[4]))

    # -- delete -----------------------------------------------------------------------------------------

    async def delete(self, keys: DurableKeys) -> None:
        """Delete the stream (only soft-delete it while forks reference it). Raises NotFound, Expired."""
        res = await self._delete(keys=scripts.DELETE.keys(keys.script_keys),
                                 args=scripts.DELETE.args({"channel": keys.channel}))
        tag = reply_text(res[0])
        if tag == "notfound":
            raise NotFound("no stream at this path")
        if tag == "gone":
            raise await self._gone(keys)
        if tag == "soft":
            await self._prune(keys)
        elif reply_text(res[1]):
            await self._release(DurableKeys.named(reply_text(res[1]), self.partitions), keys.name)

    async def _release(self, source: DurableKeys, fork_name: str) -> None:
        """Drop a fork's reference on its source; a soft-deleted source left without forks is collected, and
        so on up the chain."""
        while True:
            res = await self._unref(keys=scripts.UNREF.keys(source.script_keys),
                                    args=scripts.UNREF.args({"fork": fork_name}))
            if reply_text(res[0]) != "collected" or not reply_text(res[1]):
                return
            fork_name, source = source.name, DurableKeys.named(reply_text(res[1]), self.partitions)

    async def _prune(self, keys: DurableKeys) -> bool:
        """Drop the references of forks that expired (they never call back): True when that collected the
        stream. Bounded to PRUNE_MAX forks per visit."""
        members: Any = await self.redis.srandmember(keys.forks, PRUNE_MAX)
        for raw in members or []:
            name = reply_text(raw)
            fork = DurableKeys.named(name, self.partitions)
            if reply_text(await self.redis.hget(fork.meta, "from")) == keys.name:
                continue
            res = await self._unref(keys=scripts.UNREF.keys(keys.script_keys), args=scripts.UNREF.args({"fork": name}))
            if reply_text(res[0]) == "collected":
                if reply_text(res[1]):
                    await self._release(DurableKeys.named(reply_text(res[1]), self.partitions), keys.name)
                return True
        return False

    async def _gone(self, keys: DurableKeys) -> Exception:
        """The error for a soft-deleted stream: 410, or 404 once its last fork turned out to be gone."""
        if await self._prune(keys):
            return NotFound("no stream at this path")
        return Expired("this stream was deleted; forks still read its history")
