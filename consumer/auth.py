"""Who is calling: API keys (``--api-keys FILE``) and stream ownership.

With no keys configured every caller is the anonymous principal ("") and owns every stream. With keys,
every ``/v1`` route needs ``Authorization: Bearer <key id>.<secret>``; a stream belongs to the key that
created it, and any other key is told it does not exist (404, no existence leak).

The keys file is JSON: ``{"keys": [{"id": "alice", "sha256": "<hex sha256 of the secret>",
"limits": {...}}]}``. Secrets are never stored, only their hashes, compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request

from broker.errors import NotFound, RsbError

ANONYMOUS = ""
_KEY_ID = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")


class Unauthorized(RsbError):
    code = "unauthorized"
    status_code = 401


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: str
    sha256: bytes
    limits: dict[str, Any] = field(default_factory=dict)


class ApiKeys:
    def __init__(self, keys: list[ApiKey]) -> None:
        self._by_id = {k.id: k for k in keys}

    @property
    def enabled(self) -> bool:
        return bool(self._by_id)

    def get(self, key_id: str) -> ApiKey | None:
        return self._by_id.get(key_id)

    @classmethod
    def disabled(cls) -> ApiKeys:
        return cls([])

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        raw = orjson.loads(Path(path).read_bytes())
        keys = []
        for entry in raw.get("keys", []):
            key_id = entry["id"]
            if not _KEY_ID.match(key_id):
                raise ValueError(f"api key id {key_id!r}: use letters, digits, '_' and '-' (at most 64)")
            keys.append(ApiKey(key_id, bytes.fromhex(entry["sha256"]), dict(entry.get("limits", {}))))
        if not keys:
            raise ValueError(f"{path}: no keys")
        return cls(keys)

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


def new_key(key_id: str) -> tuple[str, dict[str, str]]:
    """A fresh secret token and the keys-file entry that accepts it."""
    secret = secrets.token_urlsafe(32)
    return f"{key_id}.{secret}", {"id": key_id, "sha256": hashlib.sha256(secret.encode()).hexdigest()}


def principal(request: Request) -> str:
    """The caller's key id (checked by the auth middleware before any /v1 route runs)."""
    return str(request.scope.get("rsb.key_id", ANONYMOUS))


def ensure_owner(owner_key_id: str, caller: str) -> None:
    if owner_key_id != caller:
        raise NotFound("no stream with this id")
