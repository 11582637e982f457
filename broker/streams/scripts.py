"""The Lua scripts behind every multi-step change to a stream. Each runs atomically inside Redis.

Meta hash fields (``StreamKeys.meta``): ``status`` (queued|running|done|cancelled|error), ``rh``
(request hash), ``req`` (canonical request JSON: dropped when the stream ends unless ``keep`` is 1, i.e. a view
reads it back: a conversation's turn, a Responses response), ``model``, ``max_tokens``, ``created_at``, ``jid``
(job entry id), ``fence`` (claim counter), ``attempts``, ``worker``, ``claimed_at``, ``seq`` (tokens
appended), ``cancel`` (reason of a pending cancel), ``last_id`` (terminal event id), ``usage`` (JSON),
``finished_at``, ``key_id``, ``retention_s``, ``abandon_s``, ``cod`` (cancel_on_disconnect),
``seen`` (last time a reader was connected, refreshed by consumer pods), ``read`` (ever read), ``tenant`` (the
key of the creating caller's counters, ``StreamKeys.tenant``), ``wm``/``wb`` (broker.streams.replication),
``wasted`` (tokens lost attempts computed and did not keep: for the usage record, broker.streams.usage).

Every appended event is also PUBLISHed on the stream's live channel as ``<id>\\n<type>\\n<data>`` so
consumer pods can tail thousands of streams over one pub/sub connection; the stream stays the source of
truth (a pod that misses a message re-reads the range). The scripts publish events through
``publish_event``, which broker.streams.replication defines per durability level: at ``replicated`` it publishes
nothing, and the events are published once a replica has them.

All keys a script touches share the partition's hash tag (broker.streams.keys), so every script runs in one
slot on Redis Cluster; that includes the keys the CLAIM script builds inside Lua (the waiting streams of
its own partition, from the prefix and suffixes broker.streams.keys passes it) and the channels it publishes
on. What the scripts share (an event's fields and payload, the final statuses) is ``PRELUDE``, generated
from their Python definitions. Replies lead with a named tag (``{'created'}``, ``{'fenced', ...}``), as
the Durable Streams scripts' do. Retrying a script whose reply was lost must be safe:
CREATE and CANCEL are idempotent, APPEND carries a sequence number, FINISH and RELEASE check the fence
and status.

On Redis Cluster the scripts SPUBLISH instead (broker.redis.connection.register_script), and a consumer pod
tails all its streams with one SSUBSCRIBE connection per master.

The scripts of Durable Streams (streams named and written by clients, broker.durable.store) are in
broker.durable.scripts.

Long because every multi-step change to a stream is one script here, beside the prelude they share; the pieces
that other concepts own (the storage quota, the usage ledger, budgets) are those modules' Lua, included.
"""

from __future__ import annotations

from broker.events import DATA_FIELD, PAYLOAD_SEPARATOR, TERMINAL_TYPES, TYPE_FIELD
from broker.redis.quota import QUOTA_LUA
from broker.streams.budget import BUDGET_LUA
from broker.streams.outbox import HOOK_LUA
from broker.streams.usage import RECORD_USAGE_LUA


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
_APPEND_EVENT = """
local function append_event(events, channel, etype, data)
  local eid = redis.call('XADD', events, '*', TYPE_FIELD, etype, DATA_FIELD, data)
  publish_event(channel, payload(eid, etype, data))
  return eid
end
"""

# Shared Lua: count an aborted generation in the partition's running totals (for /metrics; the aborted report
# reads the usage ledger). Arguments: meta field max_tokens, the record's own values.
_RECORD_ABORT = """
local function record_abort(totals_key, reason, max_tokens, prompt_tokens, completion_tokens, compute_s)
  local saved = math.max(0, tonumber(max_tokens or '0') - tonumber(completion_tokens))
  redis.call('HINCRBY', totals_key, reason .. '|streams', 1)
  redis.call('HINCRBY', totals_key, reason .. '|prompt_tokens', prompt_tokens)
  redis.call('HINCRBY', totals_key, reason .. '|completion_tokens', completion_tokens)
  redis.call('HINCRBY', totals_key, reason .. '|tokens_saved', saved)
  redis.call('HINCRBYFLOAT', totals_key, reason .. '|compute_s', compute_s)
end
"""

# Shared Lua: close a stream: terminal event, status, expiry of the stream and a tombstone that outlives
# it (so an expired id answers 410, not 404, for another retention period, then vanishes too).
_CLOSE = QUOTA_LUA + """
local function close_stream(meta, events, tomb, channel, etype, data, status, usage, now, retention)
  -- The creating caller's count of unfinished generations in this partition (same slot as the stream).
  -- With none left, its hash lives only while its rate limiter still remembers something (``tat`` ahead
  -- of now): the counters of the many addresses seen once do not pile up in Redis.
  local tenant = redis.call('HGET', meta, 'tenant')
  if tenant and redis.call('HINCRBY', tenant, 'active', -1) <= 0 then
    local t = redis.call('TIME')
    local left_ms = tonumber(redis.call('HGET', tenant, 'tat') or '0') - (t[1] * 1000 + math.floor(t[2] / 1000))
    if left_ms > 0 then redis.call('PEXPIRE', tenant, math.ceil(left_ms)) else redis.call('DEL', tenant) end
  end
  local eid = append_event(events, channel, etype, data)
  redis.call('HSET', meta, 'status', status, 'usage', usage, 'last_id', eid, 'finished_at', now)
  -- The request body was for the generation, which is over: its digest (``rh``) answers the create rule (200
  -- for the same request, 409 for another). Kept only when a view reads it back after the end (``keep``).
  -- Its bytes leave the creator's storage quota with it (broker.redis.quota), or when the stream expires.
  local q = redis.call('HMGET', meta, 'keep', 'qs')
  if q[1] ~= '1' then
    redis.call('HDEL', meta, 'req')
    if q[2] then quota_release(q[2], meta) end
  elseif q[2] then
    quota_expire(q[2], meta, string.format('%d', quota_now_ms() + retention * 1000))
  end
  redis.call('HDEL', meta, 'worker')
  redis.call('EXPIRE', meta, retention)
  redis.call('EXPIRE', events, retention)
  redis.call('SET', tomb, '1', 'EX', 2 * retention)
  return eid
end
"""

# Closes: two creates with one id racing (double generation), and a create racing the bounds it is
# checked against (the queue's, the caller's unfinished generations, the caller's create rate).
# EXISTS-then-HSET across round trips would let both callers see "absent" and both enqueue a job; a count
# read in one step and incremented in another would let a concurrent flood through past any bound.
#
# The caller's counters (``tenant``, the ``tenant`` hash of its API key or address group) live in this
# partition's slot, so that checking and counting are this one step even on Redis Cluster: each partition
# holds its share of a caller's limits (broker.streams.store.Store.create divides them). The create-rate limiter is
# GCRA (a token bucket held as one timestamp): ``tat`` is when the caller's bucket will be full again;
# a create is allowed while ``tat`` is at most (burst - 1) intervals ahead of now, and moves it one
# interval on. Time is the Redis server's (TIME), not a pod's clock: a pod whose clock runs ahead must not
# lock callers out on every other pod. Only an accepted create counts; a retry of an accepted create (same
# id, same body) is answered before any limit and costs nothing.
CREATE = PRELUDE + _APPEND_EVENT + QUOTA_LUA + BUDGET_LUA + """
-- KEYS: meta, events, jobs, qstats, tombstone, tenant, storage (the caller's: broker.redis.quota), budget (the key's
--   period: broker.streams.budget)
-- ARGV: sid, rh, req, created_at, max_queue, model, max_tokens, channel, key_id, retention_s, abandon_s, cod,
--       max_active, burst, interval_ms, max_wait_s, keep (1: the body is read back after the end), storage quota
--       (this partition's share of the caller's bytes; 0: none), affinity (the chat's key, for affine claiming),
--       budget share (0: none), reservation, the budget period's end (Unix s), webhook URL ('': none), the id
--       its event names (broker.streams.outbox)
--   max_queue, max_active, burst: this partition's share (0: no bound); interval_ms: the caller's time per
--   create in this partition (0: no rate limit); max_wait_s: bound on the estimated wait (0: none)
-- Reply: {'created'} | {'exists', status} | {'conflict'} | {'expired'} | {'storage_quota'}
--   | {'rate_limited', early_ms, ema, busy}
--   | {'too_many_generations', max_active, ema, busy} | {'queue_full', waiting, ema, busy, 'count' | 'wait'}
--   | {'budget_exceeded'}
if redis.call('EXISTS', KEYS[1]) == 1 then
  local m = redis.call('HMGET', KEYS[1], 'rh', 'status', 'key_id')
  -- Another tenant's stream is a conflict whatever the body: its status is not theirs to see.
  if m[1] == ARGV[2] and (m[3] or '') == ARGV[9] then return {'exists', m[2]} end
  return {'conflict'}
end
if redis.call('EXISTS', KEYS[5]) == 1 then return {'expired'} end
quota_sweep(KEYS[7])
if not quota_room(KEYS[7], #ARGV[3], tonumber(ARGV[18])) then return {'storage_quota'} end
local q = redis.call('HMGET', KEYS[4], 'waiting', 'ema_job_s', 'busy')
local waiting = tonumber(q[1] or '0')
-- The caller's own limits first: a flooding caller is told which of its limits it reached.
local interval = tonumber(ARGV[15])
local tat = 0
if interval > 0 then
  local t = redis.call('TIME')
  local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
  tat = math.max(tonumber(redis.call('HGET', KEYS[6], 'tat') or '0'), now_ms)
  local early_ms = tat - (tonumber(ARGV[14]) - 1) * interval - now_ms
  if early_ms > 0 then return {'rate_limited', tostring(early_ms), q[2] or '', q[3] or '0'} end
end
local max_active = tonumber(ARGV[13])
if max_active > 0 and tonumber(redis.call('HGET', KEYS[6], 'active') or '0') >= max_active then
  return {'too_many_generations', tostring(max_active), q[2] or '', q[3] or '0'}
end
local max_queue = tonumber(ARGV[5])
if max_queue > 0 and waiting >= max_queue then
  return {'queue_full', tostring(waiting), q[2] or '', q[3] or '0', 'count'}
end
-- The wait this create would have: the jobs ahead of it, at the observed job time over the running jobs.
-- Before any job finished there is no estimate, and the count bound above is the bound.
local max_wait = tonumber(ARGV[16])
if max_wait > 0 and q[2] and waiting * tonumber(q[2]) / math.max(1, tonumber(q[3] or '1')) > max_wait then
  return {'queue_full', tostring(waiting), q[2], q[3] or '0', 'wait'}
end
if not budget_reserve(KEYS[8], KEYS[1], tonumber(ARGV[20]), tonumber(ARGV[21]), ARGV[22]) then
  return {'budget_exceeded'}
end
local jid = redis.call('XADD', KEYS[3], '*', 'sid', ARGV[1], 'aff', ARGV[19])
redis.call('HSET', KEYS[1], 'status', 'queued', 'rh', ARGV[2], 'req', ARGV[3], 'created_at', ARGV[4],
  'model', ARGV[6], 'max_tokens', ARGV[7], 'jid', jid, 'fence', 0, 'attempts', 0, 'key_id', ARGV[9],
  'retention_s', ARGV[10], 'abandon_s', ARGV[11], 'cod', ARGV[12], 'seen', ARGV[4], 'read', 0, 'tenant', KEYS[6],
  'keep', ARGV[17], 'qs', KEYS[7])
quota_charge(KEYS[7], KEYS[1], #ARGV[3])
if ARGV[23] ~= '' then redis.call('HSET', KEYS[1], 'hook', ARGV[23], 'hid', ARGV[24]) end
redis.call('HINCRBY', KEYS[6], 'active', 1)
if interval > 0 then redis.call('HSET', KEYS[6], 'tat', string.format('%.0f', tat + interval)) end
redis.call('PERSIST', KEYS[6])  -- it had an expiry while the caller had nothing unfinished
redis.call('HINCRBY', KEYS[4], 'waiting', 1)
local eta = 'null'
if q[2] then
  eta = string.format('%.3f', (waiting + 1) * tonumber(q[2]) / math.max(1, tonumber(q[3] or '1')))
end
append_event(KEYS[2], ARGV[8], 'queued', '{"position":' .. (waiting + 1) .. ',"eta_s":' .. eta .. '}')
return {'created'}
"""

# Closes: two workers claiming one job (a crashed worker's entry reclaimed while it wakes up), and a
# claim racing a cancel of a queued stream. The fence counter makes every earlier claimant a zombie
# whose appends APPEND and FINISH refuse. Then, in the same step, the streams still waiting in this
# partition learn their new queue position (the first POSITION_UPDATES of them; later ones as they
# move up), so positions count down exactly once per claim.
CLAIM = PRELUDE + _APPEND_EVENT + """
-- KEYS: meta, qstats, jobs
-- ARGV: worker, now_s, group, stream_key_prefix, position_updates, meta_suffix, events_suffix, channel_suffix
--   (a waiting stream's keys: prefix .. id .. suffix, broker.streams.keys)
-- Reply: {'gone'} | {'finished'} | {'claimed', fence, attempts, req, cancel, model, seq, jid, tenant key}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'gone'} end
local st = redis.call('HGET', KEYS[1], 'status')
if ended(st) then return {'finished'} end
local now = tonumber(ARGV[2])
if st == 'queued' then
  redis.call('HINCRBY', KEYS[2], 'waiting', -1)
  redis.call('HINCRBY', KEYS[2], 'busy', 1)
end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
local fence = redis.call('HINCRBY', KEYS[1], 'fence', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1], 'claimed_at', ARGV[2])
local a = redis.call('HMGET', KEYS[1], 'abandon_s', 'seen', 'cancel')
if not a[3] and tonumber(a[1] or '0') > 0 and now - tonumber(a[2] or now) > tonumber(a[1]) then
  redis.call('HSET', KEYS[1], 'cancel', 'abandoned')
end
-- Queue positions of the streams still waiting behind this one.
local last = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[3])) do
  local name, lid = nil, nil
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] elseif g[i] == 'last-delivered-id' then lid = g[i + 1] end
  end
  if name == ARGV[3] then last = lid end
end
if last then
  local q = redis.call('HMGET', KEYS[2], 'ema_job_s', 'busy')
  local pos = 0
  for _, e in ipairs(redis.call('XRANGE', KEYS[3], '(' .. last, '+', 'COUNT', tonumber(ARGV[5]))) do
    local stream = ARGV[4] .. e[2][2]
    if redis.call('HGET', stream .. ARGV[6], 'status') == 'queued' then
      pos = pos + 1
      local eta = 'null'
      if q[1] then eta = string.format('%.3f', pos * tonumber(q[1]) / math.max(1, tonumber(q[2] or '1'))) end
      append_event(stream .. ARGV[7], stream .. ARGV[8], 'queued', '{"position":' .. pos .. ',"eta_s":' .. eta .. '}')
    end
  end
end
local m = redis.call('HMGET', KEYS[1], 'req', 'cancel', 'model', 'seq', 'jid', 'tenant')
return {'claimed', fence, attempts, m[1], m[2] or '', m[3] or '', m[4] or '0', m[5], m[6] or ''}
"""

# Closes: a zombie (a worker that lost its lease) appending after the new owner, and an append landing
# after the terminal event. Fence and status are checked in the same step as the XADD. ``seq`` (the
# number of tokens appended so far) makes a retried append whose first reply was lost a no-op, not a
# duplicate: the caller sees {'seq', current seq} and knows whether its batch landed.
_APPEND_ONE = _APPEND_EVENT + """
-- Reply: {'appended', cancel, last event id} | {'fenced', cancel} | {'seq', stored seq}
local function append_one(meta, events, fence, channel, seq_before, seq_after, first, last)
  local m = redis.call('HMGET', meta, 'fence', 'status', 'cancel', 'seq')
  if m[1] ~= fence or m[2] ~= 'running' then return {'fenced', m[3] or ''} end
  if (m[4] or '0') ~= seq_before then return {'seq', m[4] or '0'} end
  redis.call('HSET', meta, 'seq', seq_after)
  local eid = ''
  for i = first, last, 2 do
    eid = append_event(events, channel, ARGV[i], ARGV[i + 1])
  end
  return {'appended', m[3] or '', eid}
end
"""

APPEND = PRELUDE + _APPEND_ONE + """
-- KEYS: meta, events ; ARGV: fence, channel, seq_before, seq_after, type1, data1, type2, data2, ...
return append_one(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 5, #ARGV)
"""

# The appends of many streams of one partition (one slot) in one call: a worker running many generations
# at once sends one script call per partition per batch instead of one per stream (one per token at
# 20 tokens/s). Each stream's append is checked and made exactly as APPEND does it (fence, seq), and
# answered apart, in order. A refused first write (out of memory) refuses the whole call before anything
# is written; a call whose reply was lost is retried stream by stream, each answered by its seq check.
APPEND_MANY = PRELUDE + _APPEND_ONE + """
-- KEYS: meta1, events1, meta2, events2, ...
-- ARGV: per stream: fence, channel, seq_before, seq_after, n (its events), type1, data1, ..., typeN, dataN
-- Reply: one APPEND reply per stream, in order
local out = {}
local a = 1
for k = 1, #KEYS, 2 do
  local n = tonumber(ARGV[a + 4])
  out[#out + 1] = append_one(KEYS[k], KEYS[k + 1], ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], a + 5,
    a + 4 + 2 * n)
  a = a + 5 + 2 * n
end
return out
"""

# Closes: two terminal events (a zombie finishing after the new owner, or finish racing cancel-while-
# queued), and a terminal event without its status/usage/expiry/abort record (a crash between writes).
FINISH = PRELUDE + _APPEND_EVENT + _RECORD_ABORT + RECORD_USAGE_LUA + BUDGET_LUA + HOOK_LUA + _CLOSE + """
-- KEYS: meta, events, usage_index, qstats, tombstone, aborted_totals, outbox, outbox_due
-- ARGV: fence, channel, type, data, status, usage, model, now_s,
--       reason, prompt_tokens, completion_tokens, compute_s, sid, cached_tokens, wasted_tokens, ttft_ms ('': none),
--       usage_prefix
local m = redis.call('HMGET', KEYS[1], 'fence', 'status', 'model', 'max_tokens', 'key_id', 'retention_s',
  'claimed_at')
if m[1] == ARGV[1] and ended(m[2]) then
  -- A retry of this very claim's finish whose reply was lost: the same answer again.
  return redis.call('HGET', KEYS[1], 'last_id')
end
if m[1] ~= ARGV[1] or m[2] ~= 'running' then return false end
local model = m[3]
if ARGV[7] ~= '' then model = ARGV[7] end
redis.call('HSET', KEYS[1], 'model', model or '')
local now = tonumber(ARGV[8])
local eid = close_stream(KEYS[1], KEYS[2], KEYS[5], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[8],
  tonumber(m[6] or '3600'))
-- Queue statistics behind ETAs and Retry-After: running jobs, and a moving average of job time.
redis.call('HINCRBY', KEYS[4], 'busy', -1)
local took = math.max(0, now - tonumber(m[7] or now))
local ema = redis.call('HGET', KEYS[4], 'ema_job_s')
if ema then took = 0.8 * tonumber(ema) + 0.2 * took end
redis.call('HSET', KEYS[4], 'ema_job_s', string.format('%.6f', took))
record_usage(KEYS[3], ARGV[17], KEYS[1], ARGV[13], ARGV[8], ARGV[5], ARGV[9], model, ARGV[10], ARGV[14], ARGV[11],
  ARGV[15], ARGV[12], ARGV[16])
budget_settle(KEYS[1], tonumber(ARGV[10]) + tonumber(ARGV[11]))
hook_enqueue(KEYS[7], KEYS[8], KEYS[1], ARGV[13], ARGV[5], ARGV[9], ARGV[8])
if ARGV[5] ~= 'done' then
  record_abort(KEYS[6], ARGV[9], m[4], ARGV[10], ARGV[11], ARGV[12])
end
return eid
"""

# Closes: cancel racing claim (a queued stream cancelled while a worker claims it: exactly one of them
# wins, and the loser sees the other's status) and two cancels racing (one terminal event).
CANCEL = PRELUDE + _APPEND_EVENT + _RECORD_ABORT + RECORD_USAGE_LUA + BUDGET_LUA + HOOK_LUA + _CLOSE + """
-- KEYS: meta, events, qstats, usage_index, tombstone, aborted_totals, outbox, outbox_due
-- ARGV: reason, channel, cancelled_data, usage, now_s, control_channel, sid, usage_prefix
-- Reply: {'unknown'} | {'ended', status} (nothing to cancel) | {'cancelled'} (it was queued: now it ended)
--   | {'requested', status} (running: its worker stops it)
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown'} end
local m = redis.call('HMGET', KEYS[1], 'status', 'model', 'max_tokens', 'key_id', 'retention_s')
local st = m[1]
if ended(st) then return {'ended', st} end
if st == 'queued' then
  redis.call('HSET', KEYS[1], 'cancel', ARGV[1])
  close_stream(KEYS[1], KEYS[2], KEYS[5], ARGV[2], 'cancelled', ARGV[3], 'cancelled', ARGV[4], ARGV[5],
    tonumber(m[5] or '3600'))
  redis.call('HINCRBY', KEYS[3], 'waiting', -1)
  record_usage(KEYS[4], ARGV[8], KEYS[1], ARGV[7], ARGV[5], 'cancelled', ARGV[1], m[2], 0, 0, 0, 0, 0, '')
  budget_settle(KEYS[1], 0)
  hook_enqueue(KEYS[7], KEYS[8], KEYS[1], ARGV[7], 'cancelled', ARGV[1], ARGV[5])
  record_abort(KEYS[6], ARGV[1], m[3], 0, 0, 0)
  return {'cancelled'}
end
if not redis.call('HGET', KEYS[1], 'cancel') then redis.call('HSET', KEYS[1], 'cancel', ARGV[1]) end
redis.call('PUBLISH', ARGV[6], ARGV[7])
return {'requested', st}
"""

# Tokens an attempt computed and its stream will not hold (lease lost, job handed over), for its usage record.
WASTED = PRELUDE + """
-- KEYS: meta ; ARGV: tokens
local st = redis.call('HGET', KEYS[1], 'status')
if not st or ended(st) then return 0 end
return redis.call('HINCRBY', KEYS[1], 'wasted', ARGV[1])
"""

# Keeps a running job's queue entry fresh, so XAUTOCLAIM by other workers (min idle = lease) only takes
# jobs whose owner stopped renewing. Refused for a fenced-out owner, which then stops generating. Also
# where nobody-is-reading turns into a cancel: a stream unread for abandon_s, or (cancel_on_disconnect)
# read once and then left without a reader for disconnect_grace_s.
RENEW = """
-- KEYS: meta, jobs ; ARGV: fence, group, worker, jid, now_s, disconnect_grace_s
-- Reply: {'renewed', cancel reason or ''} | {'fenced'}
local m = redis.call('HMGET', KEYS[1], 'fence', 'status', 'cancel', 'abandon_s', 'cod', 'read', 'seen')
if m[1] ~= ARGV[1] or m[2] ~= 'running' then return {'fenced'} end
redis.call('XCLAIM', KEYS[2], ARGV[2], ARGV[3], 0, ARGV[4], 'JUSTID')
if m[3] then return {'renewed', m[3]} end
local now, seen = tonumber(ARGV[5]), tonumber(m[7] or ARGV[5])
local reason = ''
if tonumber(m[4] or '0') > 0 and now - seen > tonumber(m[4]) then
  reason = 'abandoned'
elseif m[5] == '1' and m[6] == '1' and now - seen > tonumber(ARGV[6]) then
  reason = 'disconnect'
end
if reason ~= '' then redis.call('HSET', KEYS[1], 'cancel', reason) end
return {'renewed', reason}
"""

# XCLAIM ... IDLE this: an entry handed back looks idle for longer than any lease, so XAUTOCLAIM takes it.
HAND_BACK_IDLE_MS = 2**31 - 1

# Hands a job over at once (a worker stopping past its grace period): its queue entry is made look
# idle for longer than any lease, so the next XAUTOCLAIM takes it, and the fence stops this worker.
RELEASE = """
-- KEYS: meta, jobs ; ARGV: fence, group, worker, jid, idle_ms
local m = redis.call('HMGET', KEYS[1], 'fence', 'status')
if m[1] ~= ARGV[1] or m[2] ~= 'running' then return 0 end
redis.call('XCLAIM', KEYS[2], ARGV[2], ARGV[3], 0, ARGV[4], 'IDLE', ARGV[5], 'JUSTID')
return 1
"""

# Records that a reader is connected (consumer pods call it every few seconds for each stream they
# serve), for any number of streams of one partition (one slot) in one call. Never creates a hash:
# touching an expired stream must not resurrect part of it.
TOUCH = """
-- KEYS: meta, meta, ... (one partition) ; ARGV: now_s
for _, meta in ipairs(KEYS) do
  if redis.call('EXISTS', meta) == 1 then redis.call('HSET', meta, 'seen', ARGV[1], 'read', 1) end
end
return 0
"""

# Chat-affine claiming. A worker that got a new job whose chat another worker ran last (that worker holds
# its prompt's prefix in its cache) leaves it for that worker, for at most wait_ms after the job was
# created: the job goes to the owner's inbox (which the owner's poll reads, so an idle owner wakes at once),
# and stays pending with this worker, made look idle for (lease_ms - what is left of the wait), so that
# when the wait is over the next XAUTOCLAIM, any worker's, takes it. An owner that died, or is busy past the
# bound, strands nothing. Only a queued job waits (a continuation after a crash runs anywhere, at once).
# The job keeps its place: the claim script counts queue positions over undelivered entries, so the jobs
# behind it are not told they wait for it.
DEFER = """
-- KEYS: jobs, affinity, meta ; ARGV: group, worker, entry_id, wait_ms, lease_ms, inbox_prefix, sid
-- Reply: 'take' | 'deferred'
local owner = redis.call('GET', KEYS[2])
if not owner or owner == ARGV[2] then return 'take' end
if redis.call('HGET', KEYS[3], 'status') ~= 'queued' then return 'take' end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local left = tonumber(ARGV[4]) - (now_ms - tonumber(string.match(ARGV[3], '^(%d+)')))
if left <= 0 then return 'take' end
-- The XADD first: with Redis full it is refused before anything is written (XCLAIM would not be).
local inbox = ARGV[6] .. owner
redis.call('XADD', inbox, 'MAXLEN', '~', 1000, '*', 'sid', ARGV[7], 'jid', ARGV[3])
redis.call('EXPIRE', inbox, 86400)
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', math.max(0, tonumber(ARGV[5]) - left), 'JUSTID')
return 'deferred'
"""

# The owner takes a job left in its inbox, if it is still queued (no other worker claimed it: the wait
# ended, or this entry is stale); XCLAIM moves the job's entry to it. The inbox entry goes either way.
TAKE = """
-- KEYS: jobs, inbox, meta ; ARGV: group, worker, jid, inbox_entry
redis.call('XACK', KEYS[2], ARGV[1], ARGV[4])
redis.call('XDEL', KEYS[2], ARGV[4])
if redis.call('HGET', KEYS[3], 'status') ~= 'queued' then return 0 end
return #redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
"""

# Drops a finished job from its queue: acknowledged and deleted in one step (a MULTI would do on one
# server, but a script is the one atomic form that works the same on Redis Cluster).
ACK = """
-- KEYS: jobs ; ARGV: group, entry_id
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return redis.call('XDEL', KEYS[1], ARGV[2])
"""

