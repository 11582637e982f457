"""The one parser of the numbers and ids clients send as text (ids, offsets, tokens, query numbers, headers):
ASCII only.

Python's own parsers accept far more than a client means: ``str.isdigit()`` and ``re``'s ``\\d`` accept every
script's digits (``"١٢٣".isdigit()``), ``"²".isdigit()`` is true and then ``int("²")`` raises, ``int()`` takes
``"+1"``, ``" 1 "`` and ``"1_000"``, and ``uuid.UUID()`` reads dashes anywhere and any Unicode digit (so one
stream would have many spellings). Redis, the protocol's peers and the other pods see only ASCII: text that is
not exactly ASCII digits (or a canonical UUID) is refused where it enters, as a 400 or a 404, never a 500.
"""

from __future__ import annotations

import re
import uuid

_DECIMAL = re.compile(r"\A[0-9]+\Z")
_UUID = re.compile(r"\A[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\Z")
_HEX32 = re.compile(r"\A[0-9a-fA-F]{32}\Z")


def is_decimal(raw: str, max_digits: int = 20) -> bool:
    """``raw`` is 1 to ``max_digits`` ASCII digits, nothing else (no sign, space or ``_``)."""
    return len(raw) <= max_digits and _DECIMAL.match(raw) is not None


def decimal(raw: str | None, max_digits: int = 20) -> int | None:
    """``raw`` as a non-negative integer when it is 1 to ``max_digits`` ASCII digits; None otherwise."""
    if raw is None or not is_decimal(raw, max_digits):
        return None
    return int(raw)


def parse_uuid(raw: object) -> uuid.UUID | None:
    """A UUID in its canonical text form (8-4-4-4-12 ASCII hex digits, any case); None for anything else."""
    if not isinstance(raw, str) or _UUID.match(raw) is None:
        return None
    return uuid.UUID(raw)


def parse_uuid_hex(raw: str) -> uuid.UUID | None:
    """A UUID as 32 ASCII hex digits (OpenAI's ``conv_``/``resp_`` spellings); None for anything else."""
    return uuid.UUID(hex=raw) if _HEX32.match(raw) else None
