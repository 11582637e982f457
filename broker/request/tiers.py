"""Service tiers: the order in which a model's queue serves waiting jobs.

``priority`` jobs are claimed before ``default`` ones, and those before ``flex`` (OpenAI's ``service_tier``
names). Inside a tier, tenants take turns (broker.streams.queue_scripts). A lower tier ages: once it has waited
``tier_aging_s`` since a claim last served it, the next claim serves it, so ``flex`` never starves behind a
steady stream of ``default`` work (and ``default`` none behind ``priority``).

``auto`` (OpenAI's default) is the key's own tier (``service_tier`` in the keys file), else ``default``. A key
may be limited to some tiers (``service_tiers`` in the keys file); asking for another is a 400. ``priority`` is
the exception, as OpenAI serves it: it runs as ``priority`` only for a key whose ``service_tiers`` name it; any other
key, and a caller without a key, asking for it is served (and echoed, and billed) as ``default``, not refused. So a
tier that goes ahead of everyone else's work is the operator's to hand out, never a client's to take.
"""

from __future__ import annotations

from collections.abc import Collection

from broker.errors import InvalidRequest

#: Served first to last.
TIERS: tuple[str, ...] = ("priority", "default", "flex")
PRIORITY = "priority"
DEFAULT = "default"
AUTO = "auto"
#: What a request may name: a tier, or ``auto``.
REQUESTABLE: tuple[str, ...] = (AUTO, *TIERS)


def resolve_tier(requested: str | None, key_tier: str = "", allowed: Collection[str] = ()) -> str:
    """The tier a create runs in. ``requested``: the request's field (None or ``auto``: the key's ``key_tier``, else
    ``default``); ``allowed``: the key's tiers (empty: every tier but ``priority``, which needs naming). Raises
    InvalidRequest naming the field."""
    tier = (key_tier or DEFAULT) if requested in (None, AUTO) else requested
    if tier not in TIERS:
        raise InvalidRequest.at(("service_tier",), f" must be one of {', '.join(REQUESTABLE)}")
    if tier == PRIORITY and PRIORITY not in allowed:
        tier = DEFAULT
    if allowed and tier not in allowed:
        raise InvalidRequest(f"this key may not use service_tier {tier!r} (it may use: {', '.join(sorted(allowed))})",
                             ("service_tier",))
    return tier
