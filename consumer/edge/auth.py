"""Who is calling: API keys (``--api-keys FILE``) and stream ownership.

With no keys configured every caller is the anonymous caller (key id "") and owns every stream. With keys,
every ``/v1`` route needs ``Authorization: Bearer <key id>.<secret>`` (or ``x-api-key: <key id>.<secret>``, as
Anthropic's clients send it: consumer.edge.middleware); a stream belongs to the key that
created it, and any other key is told it does not exist (404, no existence leak).

The keys file is JSON: ``{"keys": [{"id": "alice", "sha256": "<hex sha256 of the secret>",
"limits": {...}, "admin"?, "token_budget"?, "usd_budget"?, "budget_period"?, "team"?, "webhook_url"?,
"webhook_secret"?, "service_tier"?, "service_tiers"?, "on_busy"?, "drop_unsupported_params"?}]}`` (ApiKey). Secrets
are never stored, only their hashes, compared in constant time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from broker.ascii import decimal
from broker.errors import NotFound, StoreUnavailable, Unauthorized
from broker.request import tiers
from broker.request.on_busy import ON_BUSY
from broker.streams.budget import NO_BUDGET, TEAM_NAME, Budget, Teams, parse_budget

ANONYMOUS = ""
# A key id never starts with '-': Redis key names spell the keyless caller's share '-' (broker.streams.keys,
# broker.durable.keys, broker.redis.quota: ``key_id or '-'``), so a key named '-' read the usage, budgets, Durable
# Streams and conversations of an open deployment's callers. Nor does it look like a command-line flag.
_KEY_ID = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_-]{0,63}\Z")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A key of the keys file. Beside ``id``, ``sha256`` and ``limits``: ``admin`` (its reports show every key's
    usage), ``budget`` (``token_budget`` and ``usd_budget``, what its generations may use per ``budget_period``,
    UTC; 0: none: broker.streams.budget), ``team`` (the team whose budget it falls under too, in --teams),
    ``webhook_url`` (where its generations' ends are POSTed, instead of --webhook-url), ``webhook_secret`` (what
    signs them, instead of --webhook-secret: consumer.streaming.webhooks), ``service_tier`` (the tier
    of its creates that ask for ``auto`` or none: broker.request.tiers) and ``service_tiers`` (the tiers it may ask for;
    empty: every one but ``priority``, which only a key that names it gets: broker.request.tiers)."""

    id: str
    sha256: bytes
    limits: dict[str, Any] = field(default_factory=dict)
    admin: bool = False
    budget: Budget = NO_BUDGET
    webhook_url: str | None = None
    service_tier: str = ""
    service_tiers: tuple[str, ...] = ()
    team: str = ""
    webhook_secret: str | None = None
    #: What a conversation's turn created while another runs does when it names no ``on_busy`` (broker.request.on_busy;
    #: "": ``reject``).
    on_busy: str = ""
    #: Whether its requests drop the parameters a model cannot honour (None: as --drop-unsupported-params says).
    drop_unsupported_params: bool | None = None

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> ApiKey:
        """One entry of the keys file, checked: a wrong type is a ValueError naming the key and the field."""
        key_id = entry["id"]
        if not isinstance(key_id, str) or not _KEY_ID.match(key_id):
            raise ValueError(f"api key id {key_id!r}: use letters, digits, '_' and '-' (at most 64), and start with a "
                             "letter, a digit or '_'")
        admin, hook, team = entry.get("admin", False), entry.get("webhook_url"), entry.get("team", "")
        if not isinstance(admin, bool):
            raise ValueError(f"api key {key_id}: 'admin' must be true or false")
        budget = parse_budget(entry, key_id, "this API key's", f"api key {key_id}")
        if not isinstance(team, str) or (team and not TEAM_NAME.match(team)):
            raise ValueError(f"api key {key_id}: 'team' must be a team's name (letters, digits, '_' and '-')")
        if hook is not None and not isinstance(hook, str):
            raise ValueError(f"api key {key_id}: 'webhook_url' must be a URL")
        hook_secret = entry.get("webhook_secret")
        if hook_secret is not None and not isinstance(hook_secret, str):
            raise ValueError(f"api key {key_id}: 'webhook_secret' must be whsec_ and base64")
        tier, allowed = entry.get("service_tier", ""), entry.get("service_tiers", [])
        if tier and tier not in tiers.TIERS:
            raise ValueError(f"api key {key_id}: 'service_tier' must be one of {', '.join(tiers.TIERS)}")
        if not isinstance(allowed, list) or not all(t in tiers.TIERS for t in allowed):
            raise ValueError(f"api key {key_id}: 'service_tiers' must be a list of {', '.join(tiers.TIERS)}")
        if tier and allowed and tier not in allowed:
            raise ValueError(f"api key {key_id}: its 'service_tier' is not one of its 'service_tiers'")
        if tier == tiers.PRIORITY and tiers.PRIORITY not in allowed:  # else it would be served default in silence
            raise ValueError(f"api key {key_id}: 'service_tier' priority needs \"priority\" in its 'service_tiers'")
        on_busy, drop = entry.get("on_busy", ""), entry.get("drop_unsupported_params")
        if on_busy and on_busy not in ON_BUSY:
            raise ValueError(f"api key {key_id}: 'on_busy' must be one of {', '.join(ON_BUSY)}")
        if drop is not None and not isinstance(drop, bool):
            raise ValueError(f"api key {key_id}: 'drop_unsupported_params' must be true or false")
        return cls(key_id, bytes.fromhex(entry["sha256"]), dict(entry.get("limits", {})), admin, budget,
                   hook or None, tier, tuple(allowed), team, hook_secret or None, on_busy, drop)


class ApiKeys:
    def __init__(self, keys: list[ApiKey], token_secret: bytes = b"") -> None:
        self._by_id = {k.id: k for k in keys}
        # Signs read tokens: the configured --read-token-secret, or (set_secret_source) the deployment's random one
        # in Redis. Never derived from the keys file: it holds only hashes and is not meant to be secret.
        self._token_secret = token_secret
        self._secret_source: Callable[[], Awaitable[bytes]] | None = None
        self._refresh_s = 0.0
        self._read_at = 0.0  # monotonic time of the source's last read
        # A read token's expiry is written on one pod and checked on another: both read the Redis server's time
        # (set_clock; the process's own clock only where there is no Redis: a bare ApiKeys in a test).
        self._now: Callable[[], Awaitable[float]] = _process_now

    def set_secret_source(self, source: Callable[[], Awaitable[bytes]], refresh_s: float) -> None:
        """Where the signing key comes from when none is configured: read on first use, then again every
        ``refresh_s`` (so a rotation, or a Redis that lost its data, reaches every pod within that)."""
        self._secret_source = source
        self._refresh_s = refresh_s

    def set_clock(self, now: Callable[[], Awaitable[float]]) -> None:
        """Where a read token's time comes from: the Redis server's (broker.redis.server_clock.ServerClock.now)."""
        self._now = now

    async def token_secret(self) -> bytes:
        """The read-token signing key. Raises what its source raises when there is no key yet (Redis away: the
        caller's 503); once there is one, a failed re-read keeps it until the next try."""
        source = self._secret_source
        if source is None:
            if not self._token_secret:
                raise RuntimeError("read tokens need a --read-token-secret or a secret source")
            return self._token_secret
        now = time.monotonic()
        if self._token_secret and now - self._read_at < self._refresh_s:
            return self._token_secret
        self._read_at = now  # one re-read at a time, not one per concurrent request
        try:
            self._token_secret = await source()
        except Exception as e:
            if not self._token_secret or not isinstance(e, StoreUnavailable):
                self._read_at = 0.0
                raise
        return self._token_secret

    @property
    def enabled(self) -> bool:
        return bool(self._by_id)

    def get(self, key_id: str) -> ApiKey | None:
        return self._by_id.get(key_id)

    def all(self) -> list[ApiKey]:
        return list(self._by_id.values())

    def check_budgets(self, teams: Teams | None, priced: bool) -> None:
        """At start: every key's ``team`` is in --teams, and budgets in USD have --prices. Raises ValueError naming
        the key (or team) and the flag."""
        for k in self._by_id.values():
            if k.team and (teams is None or teams.get(k.team) is None):
                raise ValueError(f"api key {k.id}: its team {k.team!r} is not in --teams")
            if k.budget.usd > 0 and not priced:
                raise ValueError(f"api key {k.id}: a 'usd_budget' needs --prices (what a generation costs)")
        for name, budget in (teams.budgets.items() if teams is not None else ()):
            if budget.usd > 0 and not priced:
                raise ValueError(f"team {name}: a 'usd_budget' needs --prices (what a generation costs)")

    @classmethod
    def disabled(cls) -> ApiKeys:
        return cls([])

    @classmethod
    def load(cls, path: str | Path, token_secret: str | None = None) -> ApiKeys:
        raw = orjson.loads(Path(path).read_bytes())
        keys = []
        for entry in raw.get("keys", []):
            keys.append(ApiKey.from_entry(entry))
        if not keys:
            raise ValueError(f"{path}: no keys")
        return cls(keys, token_secret.encode() if token_secret else b"")

    def authenticate(self, authorization: str | None) -> str:
        """The key id of a valid ``Bearer <id>.<secret>``; raises Unauthorized otherwise."""
        if not self.enabled:
            return ANONYMOUS
        if not authorization or not authorization.startswith("Bearer "):
            raise Unauthorized("missing 'Authorization: Bearer <api key>'")
        token = authorization[len("Bearer "):].strip()
        key_id, _, secret = token.partition(".")
        key = self._by_id.get(key_id)
        # Hash and compare even for an unknown id, so timing does not tell which ids exist.
        digest = hashlib.sha256(secret.encode()).digest()
        expected = key.sha256 if key is not None else b"\0" * 32
        if not (hmac.compare_digest(digest, expected) and key is not None):
            raise Unauthorized("invalid api key")
        return key.id


    # -- read tokens: EventSource cannot send headers, so a create answers a signed, short-lived token
    #    that reads (events, status) exactly one stream, for its owner only.

    @staticmethod
    def sign(secret: bytes, stream_id: uuid.UUID, key_id: str, exp: int) -> str:
        mac = hmac.new(secret, f"{stream_id}|{key_id}|{exp}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac[:24]).decode().rstrip("=")

    async def issue_read_token(self, stream_id: uuid.UUID, key_id: str, ttl_s: int) -> str:
        exp = int(await self._now()) + ttl_s
        return f"{exp}.{key_id}.{self.sign(await self.token_secret(), stream_id, key_id, exp)}"

    async def check_read_token(self, token: str, stream_id: uuid.UUID) -> str:
        """The key id the token was issued to, if it is valid for this stream now; else Unauthorized."""
        exp_raw, _, rest = token.partition(".")
        key_id, _, sig = rest.partition(".")
        exp = decimal(exp_raw, max_digits=12)
        if exp is None or self._by_id.get(key_id) is None:
            raise Unauthorized("invalid read token")
        expected = self.sign(await self.token_secret(), stream_id, key_id, exp)
        if not hmac.compare_digest(sig.encode(), expected.encode()):
            raise Unauthorized("invalid read token")
        if exp < await self._now():
            raise Unauthorized("read token expired; create the stream again (same id and body) for a fresh one")
        return key_id


async def _process_now() -> float:
    return time.time()


def new_key(key_id: str) -> tuple[str, dict[str, str]]:
    """A fresh secret token and the keys-file entry that accepts it."""
    secret = secrets.token_urlsafe(32)
    return f"{key_id}.{secret}", {"id": key_id, "sha256": hashlib.sha256(secret.encode()).hexdigest()}


def ensure_owner(owner_key_id: str, caller: str) -> None:
    if owner_key_id != caller:
        raise NotFound("no stream with this id")
