"""How Durable Streams data looks (broker.durable.store stores it): offsets, content types, and JSON mode's stored
form. Pure functions, no Redis.

Offsets are Redis entry ids rendered ``%016d_%016d``: fixed width, so byte order is numeric order, offsets sort
lexicographically and strictly increase, and ``0000000000000000_0000000000000000`` is the start of every stream.
JSON mode stores each POST's items as compact JSON (never a raw newline) joined by ``\\n``, so a read joins
entries into one array without parsing anything.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from broker.events import parse_event_id

ZERO_ID = "0-0"
JSON_TYPE = "application/json"
DEFAULT_TYPE = "application/octet-stream"



def offset_of(entry_id: str) -> str:
    """The protocol offset of a Redis entry id: ``1795948061229-3`` -> ``0001795948061229_0000000000000003``."""
    ms, _, seq = entry_id.partition("-")
    return f"{int(ms):016d}_{int(seq):016d}"


def entry_id_of(offset: str) -> str | None:
    """The Redis id of a well-formed offset (digits, ``_``, digits: each part an unsigned 64-bit number)."""
    ms, sep, seq = offset.partition("_")
    key = parse_event_id(f"{ms}-{seq}") if sep and "-" not in offset else None
    return None if key is None else f"{key[0]}-{key[1]}"


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def normalize_content_type(raw: str) -> str:
    """The media type, for comparisons: parameters dropped, trimmed, lowercased."""
    return raw.split(";", 1)[0].strip().lower()


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("JSON numbers must be finite")
    return value


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def encode_json(body: bytes, *, allow_empty: bool) -> bytes | None:
    """A JSON-mode body in its stored form: a top-level array is flattened one level (each element is one
    message), anything else is one message; items compact, joined by newlines. None: not JSON (or ``[]``,
    unless ``allow_empty``: a PUT may create an empty stream, a POST must append something)."""
    try:
        value = json.loads(body.decode("utf-8"), parse_float=_finite, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    if not items and not allow_empty:
        return None
    try:
        return "\n".join(json.dumps(item, ensure_ascii=False, separators=(",", ":")) for item in items).encode()
    except (ValueError, RecursionError):
        return None


def json_array(stored: Iterable[bytes]) -> bytes:
    """Stored JSON-mode entries as one JSON array."""
    return b"[" + b",".join(e.replace(b"\n", b",") for e in stored if e) + b"]"
