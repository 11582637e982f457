"""Lua scripts whose KEYS and ARGV are named once, in Python.

A script reads ``K.meta`` and ``A.fence``, not ``KEYS[1]`` and ``ARGV[9]``: ``Lua`` generates the table that maps
each name to its position from the same tuple the Python caller fills by name (``keys()`` and ``args()``), so a
script and its callers cannot disagree on an order, and adding an argument is one edit. Scripts that take a
variable tail read it past the named ones (``A_NAMES``); a tail of records (one per stream of a batch) names
their fields the same way, with ``record_reader``.

Also the Lua every script shares to read the server's clock: ``SERVER_MS`` (time is the Redis server's, never a
pod's, so that pods whose clocks disagree agree on leases, rates and ages).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: ``server_ms()``: the Redis server's time, Unix milliseconds (an integer; TIME is allowed in scripts since
#: Redis 5's effects replication).
SERVER_MS = """
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""


def record_reader(function: str, names: tuple[str, ...]) -> str:
    """Lua ``function(t, i)``: the record of ``names`` that starts at ``t[i]``, as a table by name. A caller fills a
    record with ``Lua.record(names, values)``, so both sides read the one tuple."""
    fields = ", ".join(f"{name} = t[i + {n}]" for n, name in enumerate(names))
    return f"local function {function}(t, i) return {{{fields}}} end\n"


def _table(var: str, source: str, names: tuple[str, ...]) -> str:
    fields = ", ".join(f"{name} = {source}[{i}]" for i, name in enumerate(names, 1))
    return f"local {var} = {{{fields}}}\nlocal {var}_NAMES = {len(names)}\n"


@dataclass(frozen=True)
class Lua:
    """A script's body with its named KEYS (``K.<name>``) and ARGV (``A.<name>``)."""

    body: str
    key_names: tuple[str, ...] = ()
    arg_names: tuple[str, ...] = ()
    prelude: str = field(default="", repr=False)  # shared Lua placed before the names (functions it defines)

    def __post_init__(self) -> None:
        for names in (self.key_names, self.arg_names):
            if len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
                raise ValueError(f"script names must be distinct identifiers: {names}")

    @property
    def text(self) -> str:
        return (self.prelude + _table("K", "KEYS", self.key_names) + _table("A", "ARGV", self.arg_names)
                + self.body)

    def keys(self, named: Mapping[str, str], *rest: Any) -> list[Any]:
        """KEYS in the declared order (every name given, no other), then ``rest``."""
        return _ordered(self.key_names, named, "key") + list(rest)

    def args(self, named: Mapping[str, Any], *rest: Any) -> list[Any]:
        """ARGV in the declared order (every name given, no other), then ``rest``."""
        return _ordered(self.arg_names, named, "argument") + list(rest)


def record(names: tuple[str, ...], named: Mapping[str, Any]) -> list[Any]:
    """One record of a script's tail (read in Lua by ``record_reader(..., names)``), in the declared order."""
    return _ordered(names, named, "record field")


def _ordered(names: tuple[str, ...], named: Mapping[str, Any], what: str) -> list[Any]:
    if named.keys() != set(names):
        missing, extra = set(names) - named.keys(), named.keys() - set(names)
        raise TypeError(f"script {what}s: missing {sorted(missing)}, unknown {sorted(extra)}")
    return [named[n] for n in names]
