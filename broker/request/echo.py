"""Request fields rsb keeps only to show them back, as OpenAI's objects do: ``metadata``, ``user``,
``safety_identifier`` and ``store``. They change no generation; they are part of the stored request (so a retry
with other metadata is another request, a 409 on the same id) and the Responses objects echo them."""

from __future__ import annotations

from typing import Any

from broker.errors import InvalidRequest

FIELDS = ("metadata", "user", "safety_identifier", "store")
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's
MAX_ID_CHARS = 256


def parse_echo(body: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The echoed fields a create body sets, validated, in FIELDS order (empty: none)."""
    out: list[tuple[str, Any]] = []
    meta = body.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict) or len(meta) > MAX_METADATA_KEYS or not all(
                isinstance(k, str) and len(k) <= MAX_METADATA_KEY_CHARS and isinstance(v, str)
                and len(v) <= MAX_METADATA_VALUE_CHARS for k, v in meta.items()):
            raise InvalidRequest.at(("metadata",), f" must map at most {MAX_METADATA_KEYS} keys of at most "
                                 f"{MAX_METADATA_KEY_CHARS} characters to strings of at most "
                                 f"{MAX_METADATA_VALUE_CHARS}")
        if meta:
            out.append(("metadata", dict(meta)))
    for name in ("user", "safety_identifier"):
        v = body.get(name)
        if v is not None:
            if not isinstance(v, str) or len(v) > MAX_ID_CHARS:
                raise InvalidRequest.at((name,), f" must be a string of at most {MAX_ID_CHARS} characters")
            out.append((name, v))
    store = body.get("store")
    if store is not None:
        if not isinstance(store, bool):
            raise InvalidRequest.at(("store",), " must be true or false")
        out.append(("store", store))
    return tuple(out)
