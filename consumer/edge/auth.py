"""Who is calling: API keys (``--api-keys FILE``) and stream ownership.

With no keys configured every caller is the anonymous principal ("") and owns every stream. With keys,
every ``/v1`` route needs ``Authorization: Bearer <key id>.<secret>``; a stream belongs to the key that
created it, and any other key is told it does not exist (404, no existence leak).

The keys file is JSON: ``{"keys": [{"id": "alice", "sha256": "<hex sha256 of the secret>",
"limits": {...}}]}``. Secrets are never stored, only their hashes, compared in constant time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from broker.errors import NotFound, Unauthorized

ANONYMOUS = ""
_KEY_ID = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: str
    sha256: bytes
    limits: dict[str, Any] = field(default_factory=dict)


class ApiKeys:
    def __init__(self, keys: list[ApiKey], token_secret: bytes = b"") -> None:
        self._by_id = {k.id: k for k in keys}
        # Signs read tokens. Pods that share the keys file share the secret unless one is configured.
        self.token_secret = token_secret or hashlib.sha256(
            b"rsb-read-token|" + b"|".join(k.id.encode() + k.sha256 for k in keys)).digest()

    @property
    def enabled(self) -> bool:
        return bool(self._by_id)

    def get(self, key_id: str) -> ApiKey | None:
        return self._by_id.get(key_id)

    @classmethod
    def disabled(cls) -> ApiKeys:
        return cls([])

    @classmethod
    def load(cls, path: str | Path, token_secret: str | None = None) -> ApiKeys:
        raw = orjson.loads(Path(path).read_bytes())
        keys = []
        for entry in raw.get("keys", []):
            key_id = entry["id"]
            if not _KEY_ID.match(key_id):
                raise ValueError(f"api key id {key_id!r}: use letters, digits, '_' and '-' (at most 64)")
            keys.append(ApiKey(key_id, bytes.fromhex(entry["sha256"]), dict(entry.get("limits", {}))))
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

    def _sign(self, stream_id: uuid.UUID, key_id: str, exp: int) -> str:
        mac = hmac.new(self.token_secret, f"{stream_id}|{key_id}|{exp}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac[:24]).decode().rstrip("=")

    def issue_read_token(self, stream_id: uuid.UUID, key_id: str, ttl_s: int) -> str:
        exp = int(time.time()) + ttl_s
        return f"{exp}.{key_id}.{self._sign(stream_id, key_id, exp)}"

    def check_read_token(self, token: str, stream_id: uuid.UUID) -> str:
        """The key id the token was issued to, if it is valid for this stream now; else Unauthorized."""
        exp_raw, _, rest = token.partition(".")
        key_id, _, sig = rest.partition(".")
        if not exp_raw.isdigit() or len(exp_raw) > 12 or self._by_id.get(key_id) is None:
            raise Unauthorized("invalid read token")
        exp = int(exp_raw)
        if not hmac.compare_digest(sig.encode(), self._sign(stream_id, key_id, exp).encode()):
            raise Unauthorized("invalid read token")
        if exp < time.time():
            raise Unauthorized("read token expired; create the stream again (same id and body) for a fresh one")
        return key_id


def new_key(key_id: str) -> tuple[str, dict[str, str]]:
    """A fresh secret token and the keys-file entry that accepts it."""
    secret = secrets.token_urlsafe(32)
    return f"{key_id}.{secret}", {"id": key_id, "sha256": hashlib.sha256(secret.encode()).hexdigest()}


def ensure_owner(owner_key_id: str, caller: str) -> None:
    if owner_key_id != caller:
        raise NotFound("no stream with this id")
