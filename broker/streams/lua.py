"""The Lua every script of a stream shares, generated from the Python definitions of what it encodes: an event's
stream-entry fields and pub/sub payload (broker.events), the final statuses, and appending an event. The scripts
themselves: broker.streams.scripts (a stream's life) and broker.streams.queue_scripts (its job's)."""

from __future__ import annotations

from broker.events import DATA_FIELD, PAYLOAD_SEPARATOR, TERMINAL_TYPES, TYPE_FIELD


def lua_string(value: bytes | str) -> str:
    """``value`` as a Lua string literal."""
    text = value.decode() if isinstance(value, bytes) else value
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


#: What every script of a stream shares, as Lua generated from the one Python definition of each: an event's
#: stream-entry fields and its pub/sub payload (broker.events), and which statuses are final (a stream's final
#: status is its terminal event's type).
PRELUDE = f"""
local TYPE_FIELD, DATA_FIELD, SEP = {lua_string(TYPE_FIELD)}, {lua_string(DATA_FIELD)}, {lua_string(PAYLOAD_SEPARATOR)}
local TERMINAL = {{{", ".join(f"[{lua_string(t)}] = true" for t in sorted(TERMINAL_TYPES))}}}
local function ended(status) return TERMINAL[status] == true end
-- An event as pub/sub carries it (broker.events.Event.from_payload).
local function payload(eid, etype, data) return eid .. SEP .. etype .. SEP .. data end
-- An XRANGE entry {{id, {{field, value, ...}}}} as its payload, its fields read by name.
local function entry_payload(e)
  local etype, data
  for i = 1, #e[2], 2 do
    if e[2][i] == TYPE_FIELD then etype = e[2][i + 1] elseif e[2][i] == DATA_FIELD then data = e[2][i + 1] end
  end
  return payload(e[1], etype, data)
end
"""

# Shared Lua: append one event to a stream and publish it, through ``publish_event`` (defined per durability
# level in front of the script: broker.streams.replication.prepare).
APPEND_EVENT = """
local function append_event(events, channel, etype, data)
  local eid = redis.call('XADD', events, '*', TYPE_FIELD, etype, DATA_FIELD, data)
  publish_event(channel, payload(eid, etype, data))
  return eid
end
"""

