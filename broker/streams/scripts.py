"""The Lua scripts behind every multi-step change to a stream. Each runs atomically inside Redis.

Meta hash fields (``StreamKeys.meta``): ``status`` (queued|running|done|cancelled|error), ``rh``
(request hash), ``req`` (canonical request JSON: dropped when the stream ends unless ``keep`` is 1, i.e. a view
reads it back: a conversation's turn, a Responses response), ``model``, ``max_tokens``, ``created_at``, ``jid``
(its backlog entry: broker.streams.keys.QueueKeys), ``fence`` (claim counter), ``attempts``, ``worker``,
``claimed_at`` (the last claim), ``started_at`` (the first claim), ``seq`` (tokens
appended), ``cancel`` (reason of a pending cancel), ``last_id`` (terminal event id), ``usage`` (JSON),
``finished_at``, ``key_id``, ``retention_s``, ``abandon_s``, ``cod`` (cancel_on_disconnect),
``seen`` (last time a reader was connected, refreshed by consumer pods' TOUCH), ``read`` (ever read), ``tenant`` (the
key of the creating caller's counters, ``StreamKeys.tenant``), ``wm``/``wb`` (broker.streams.replication),
``wasted`` (tokens lost attempts computed and did not keep: for the usage record, broker.streams.usage);
``tp`` (the W3C traceparent of the create's span, when tracing is on: broker.telemetry; every attempt's generation
span is its child); ``held`` (1: a conversation's turn that waits for the turn before it to end, queued but in no
line until UNHOLD puts it in one: broker.request.on_busy);
where its job waits: ``qp``, ``tier``, ``who``, ``aff`` (broker.streams.queue_scripts, which holds the job
queue's scripts: claim, renew, release, give back).

Every appended event is also PUBLISHed on the stream's live channel as ``<id>\\n<type>\\n<data>`` so
consumer pods can tail thousands of streams over one pub/sub connection; the stream stays the source of
truth (a pod that misses a message re-reads the range). The scripts publish events through
``publish_event``, which broker.streams.replication defines per durability level: at ``replicated`` it publishes
nothing, and the events are published once a replica has them.

All keys a script touches share the partition's hash tag (broker.streams.keys), so every script runs in one
slot on Redis Cluster; that includes the keys the queue's scripts build inside Lua (the waiting streams and
tenant lines of its own partition, with builders generated from broker.streams.keys's templates) and the
channels they publish on. What the scripts share (an event's fields and payload, the final statuses) is
broker.streams.lua's ``PRELUDE``, generated from their Python definitions; KEYS and ARGV are named once, in
Python (broker.redis.lua). Every time a script stores or compares (``created_at``, ``seen``, ``claimed_at``,
``started_at``, ``finished_at``, leases, the ledger's and the outbox's times) is the Redis server's, read in the script
(TIME): no pod passes its clock, so pods whose clocks disagree agree on leases, abandonment, waits and webhooks.
Replies lead with a named tag (``{'created'}``, ``{'fenced', ...}``), as
the Durable Streams scripts' do. Retrying a script whose reply was lost must be safe:
CREATE and CANCEL are idempotent, APPEND carries a sequence number, FINISH and the queue's scripts check the
fence and status.

On Redis Cluster the scripts SPUBLISH instead (broker.redis.connection.register_script), and a consumer pod
tails all its streams with one SSUBSCRIBE connection per master.

The scripts of Durable Streams (streams named and written by clients, broker.durable.store) are in
broker.durable.scripts.

Every multi-step change to a stream is one script here; the pieces that other concepts own (the prelude,
broker.streams.lua; the storage quota, the usage ledger, budgets) are those modules' Lua, included.
"""

from __future__ import annotations

from broker.redis.connection import REFUSE_WHEN_FULL
from broker.redis.lua import SERVER_MS, Lua, record_reader
from broker.redis.quota import QUOTA_LUA
from broker.streams.budget import BUDGET_LUA
from broker.streams.lua import APPEND_EVENT, PRELUDE
from broker.streams.outbox import HOOK_LUA
from broker.streams.queue_scripts import QUEUE
from broker.streams.usage import RECORD_USAGE_LUA

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
_CLOSE = """
local function close_stream(meta, events, tomb, channel, etype, data, status, usage, now, retention)
  -- The creating caller's count of unfinished generations in this partition (same slot as the stream).
  -- With none left, its hash lives only while its rate limiter still remembers something (``tat`` ahead
  -- of now): the counters of the many addresses seen once do not pile up in Redis.
  local tenant = redis.call('HGET', meta, 'tenant')
  if tenant and redis.call('HINCRBY', tenant, 'active', -1) <= 0 then
    local left_ms = tonumber(redis.call('HGET', tenant, 'tat') or '0') - server_ms()
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
    quota_expire(q[2], meta, string.format('%d', server_ms() + retention * 1000))
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
# holds its share of a caller's limits (broker.streams.stream_store.StreamStore.create divides them). The create-rate
# limiter is GCRA (a token bucket held as one timestamp): ``tat`` is when the caller's bucket will be full again;
# a create is allowed while ``tat`` is at most (burst - 1) intervals ahead of now, and moves it one
# interval on. Time is the Redis server's (TIME), not a pod's clock: a pod whose clock runs ahead must not
# lock callers out on every other pod. Only an accepted create counts; a retry of an accepted create (same
# id, same body) is answered before any limit and costs nothing.
CREATE = Lua(PRELUDE + APPEND_EVENT + QUOTA_LUA + BUDGET_LUA + QUEUE + """
-- K.tenant: the caller's counters; K.storage: its storage quota (broker.redis.quota); K.budget, K.team_budget: the
--   key's and its team's period (broker.streams.budget); K.stats, K.backlog: the model's queue
--   (broker.streams.keys.QueueKeys, prefix A.qp)
-- A.max_queue, A.max_active, A.burst: this partition's share (0: no bound); A.interval_ms: the caller's time per
--   create in this partition (0: no rate limit); A.max_wait_s: bound on the estimated wait (0: none); A.keep: 1 if
--   the body is read back after the end; A.storage_share: this partition's share of the caller's bytes (0: none);
--   A.affinity: the chat's key (chat-affine claiming); A.max_hooks: this partition's share of the caller's pending
--   webhook events (0: none); A.budget_share, A.usd_share, A.team_share, A.team_usd_share
--   (0: none), A.reservation (tokens), A.usd_reservation (nano-USD), A.price, A.period_end, A.team_period_end (Unix
--   s); A.hook: the webhook URL ('': none), A.hid: the id its event names (broker.streams.outbox); A.tier, A.who:
--   the job's tier and tenant (broker.request.tiers, broker.streams.keys.tenant_of); A.trace: the create span's
--   traceparent ('': not traced); A.held: the data of its `queued` event when the job is held (a conversation's turn
--   waiting for the one before it: it gets into its line at UNHOLD; the queue's bounds are its then), '' otherwise;
--   A.workers: the generators serving the model as the consumer knows them ('': unknown), told in the ``queued`` event
-- Reply: {'created'} | {'exists', status} | {'conflict'} | {'expired'} | {'storage_quota'}
--   | {'rate_limited', early_ms, ema, busy}
--   | {'too_many_generations', max_active, ema, busy} | {'queue_full', waiting, ema, busy, 'count' | 'wait'}
--   | {'budget_exceeded', 'key' | 'team', 'tokens' | 'usd'} | {'webhook_backlog', pending}
if redis.call('EXISTS', K.meta) == 1 then
  local m = redis.call('HMGET', K.meta, 'rh', 'status', 'key_id')
  -- Another tenant's stream is a conflict whatever the body: its status is not theirs to see.
  if m[1] == A.rh and (m[3] or '') == A.key_id then return {'exists', m[2]} end
  return {'conflict'}
end
if redis.call('EXISTS', K.tombstone) == 1 then return {'expired'} end
quota_sweep(K.storage)
if not quota_room(K.storage, #A.req, tonumber(A.storage_share)) then return {'storage_quota'} end
-- Its webhook events waiting for its receiver (broker.streams.outbox), if this create would add one.
local pending = tonumber(redis.call('HGET', K.storage, 'hooks') or '0')
if A.hook ~= '' and tonumber(A.max_hooks) > 0 and pending >= tonumber(A.max_hooks) then
  return {'webhook_backlog', tostring(pending)}
end
local waiting = tonumber(redis.call('HGET', K.totals, 'waiting') or '0')
local q = redis.call('HMGET', K.stats, 'waiting', 'ema_job_s', 'busy')
local model_waiting = tonumber(q[1] or '0')
-- The caller's own limits first: a flooding caller is told which of its limits it reached.
local interval = tonumber(A.interval_ms)
local now_ms = server_ms()
local tat = 0
if interval > 0 then
  tat = math.max(tonumber(redis.call('HGET', K.tenant, 'tat') or '0'), now_ms)
  local early_ms = tat - (tonumber(A.burst) - 1) * interval - now_ms
  if early_ms > 0 then return {'rate_limited', tostring(early_ms), q[2] or '', q[3] or '0'} end
end
local max_active = tonumber(A.max_active)
if max_active > 0 and tonumber(redis.call('HGET', K.tenant, 'active') or '0') >= max_active then
  return {'too_many_generations', tostring(max_active), q[2] or '', q[3] or '0'}
end
local held = A.held ~= ''
local max_queue = tonumber(A.max_queue)
if not held and max_queue > 0 and waiting >= max_queue then
  return {'queue_full', tostring(waiting), q[2] or '', q[3] or '0', 'count'}
end
-- The wait this create would have: the jobs its model's claims take before it, at the observed job time over the
-- running jobs. Before any job finished there is no estimate, and the count bound above is the bound.
local position = new_position(A.qp, A.tier, A.who, tonumber(A.position_updates))
local max_wait = tonumber(A.max_wait_s)
if not held and max_wait > 0 and q[2] and (position - 1) * tonumber(q[2]) / math.max(1, tonumber(q[3] or '1'))
    > max_wait then
  return {'queue_full', tostring(model_waiting), q[2], q[3] or '0', 'wait'}
end
local amount, usd = tonumber(A.reservation), tonumber(A.usd_reservation)
local budgets = {{K.budget, tonumber(A.budget_share), tonumber(A.usd_share), A.period_end, 'key', 'bkey'},
  {K.team_budget, tonumber(A.team_share), tonumber(A.team_usd_share), A.team_period_end, 'team', 'tkey'}}
for _, b in ipairs(budgets) do
  local over = budget_fits(b[1], b[2], b[3], amount, usd)
  if over then return {'budget_exceeded', b[5], over} end
end
-- Its birth, and the first sign of a reader, in the server's time: every pod compares them with the server's.
local created_at = string.format('%.6f', now_ms / 1000)
redis.call('HSET', K.meta, 'status', 'queued', 'rh', A.rh, 'req', A.req, 'created_at', created_at,
  'model', A.model, 'max_tokens', A.max_tokens, 'fence', 0, 'attempts', 0, 'key_id', A.key_id,
  'retention_s', A.retention_s, 'abandon_s', A.abandon_s, 'cod', A.cod, 'seen', created_at, 'read', 0,
  'tenant', K.tenant, 'keep', A.keep, 'qs', K.storage, 'qp', A.qp, 'tier', A.tier, 'who', A.who,
  'aff', A.affinity, 'urs', A.usage_retention_s)
quota_charge(K.storage, K.meta, #A.req)
for _, b in ipairs(budgets) do
  if b[2] > 0 or b[3] > 0 then
    budget_hold(b[1], amount, usd, b[4])
    redis.call('HSET', K.meta, b[6], b[1], 'bres', A.reservation, 'bures', A.usd_reservation, 'bprice', A.price)
  end
end
if A.hook ~= '' then redis.call('HSET', K.meta, 'hook', A.hook, 'hid', A.hid) end
if A.trace ~= '' then redis.call('HSET', K.meta, 'tp', A.trace) end
redis.call('HINCRBY', K.tenant, 'active', 1)
if interval > 0 then redis.call('HSET', K.tenant, 'tat', string.format('%.0f', tat + interval)) end
redis.call('PERSIST', K.tenant)  -- it had an expiry while the caller had nothing unfinished
if held then
  redis.call('HSET', K.meta, 'held', 1)
  append_event(K.events, A.channel, 'queued', A.held)
  return {'created'}
end
redis.call('HSET', K.meta, 'jid', redis.call('XADD', K.backlog, '*', 'sid', A.sid))
enqueue(A.qp, A.tier, A.who, A.sid, K.totals, now_ms, false)
append_event(K.events, A.channel, 'queued', queued_data(position, K.stats, A.workers))
return {'created'}
""", key_names=("meta", "events", "totals", "stats", "backlog", "tombstone", "tenant", "storage", "budget",
                "team_budget"),
    arg_names=("sid", "rh", "req", "max_queue", "model", "max_tokens", "channel", "key_id",
               "retention_s", "abandon_s", "cod", "max_active", "burst", "interval_ms", "max_wait_s", "keep",
               "storage_share", "affinity", "budget_share", "usd_share", "team_share", "team_usd_share",
               "reservation", "usd_reservation", "price", "period_end", "team_period_end", "hook", "hid", "qp",
               "tier", "who", "position_updates", "usage_retention_s", "max_hooks", "trace", "held", "workers"))

# Closes: a held turn (CREATE's A.held) started twice (every pod that settles its conversation, and the worker that
# folded the turn before it, may start it at once), or started after a cancel ended it. Its request becomes the one
# its conversation's history at its start makes (A.req: the history in front of its messages), and its job gets into
# its line as CREATE would have put it there, in one step, once.
# Reply: {'started'} | {'not_held', status}
UNHOLD = Lua(PRELUDE + APPEND_EVENT + QUOTA_LUA + QUEUE + """
local m = redis.call('HMGET', K.meta, 'status', 'held', 'qp', 'tier', 'who', 'req', 'qs')
if m[1] ~= 'queued' or m[2] ~= '1' then return {'not_held', m[1] or ''} end
local position = new_position(m[3], m[4], m[5], tonumber(A.position_updates))
redis.call('HSET', K.meta, 'req', A.req, 'held', 0, 'jid', redis.call('XADD', K.backlog, '*', 'sid', A.sid))
-- The history it now carries is its owner's to hold, as any request's (past the quota too: the turn was admitted).
if m[7] then quota_charge(m[7], K.meta, #A.req - #(m[6] or '')) end
enqueue(m[3], m[4], m[5], A.sid, K.totals, server_ms(), false)
append_event(K.events, A.channel, 'queued', queued_data(position, K.stats))
return {'started'}
""", key_names=("meta", "events", "totals", "stats", "backlog"),
    arg_names=("sid", "req", "channel", "position_updates"))

# Closes: a zombie (a worker that lost its lease) appending after the new owner, and an append landing
# after the terminal event. Fence and status are checked in the same step as the XADD. ``seq`` (the
# number of tokens appended so far) makes a retried append whose first reply was lost a no-op, not a
# duplicate: the caller sees {'seq', current seq} and knows whether its batch landed.
_APPEND_ONE = APPEND_EVENT + """
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

APPEND = Lua(PRELUDE + _APPEND_ONE + """
-- Past the named ARGV: type1, data1, type2, data2, ...
return append_one(K.meta, K.events, A.fence, A.channel, A.seq_before, A.seq_after, A_NAMES + 1, #ARGV)
""", key_names=("meta", "events"), arg_names=("fence", "channel", "seq_before", "seq_after"))

#: APPEND_MANY's records: per stream, its KEYS, then its ARGV (``events``: how many (type, data) pairs follow).
APPEND_MANY_KEYS = ("meta", "events")
APPEND_MANY_ARGS = ("fence", "channel", "seq_before", "seq_after", "events")

# The appends of many streams of one partition (one slot) in one call: a worker running many generations
# at once sends one script call per partition per batch instead of one per stream (one per token at
# 20 tokens/s). Each stream's append is checked and made exactly as APPEND does it (fence, seq), and
# answered apart, in order. A refused first write (out of memory) refuses the whole call before anything
# is written; a call whose reply was lost is retried stream by stream, each answered by its seq check.
APPEND_MANY = Lua(PRELUDE + _APPEND_ONE + record_reader("stream_keys", APPEND_MANY_KEYS)
                  + record_reader("stream_args", APPEND_MANY_ARGS) + f"""
-- KEYS: one APPEND_MANY_KEYS record per stream; ARGV: per stream, its APPEND_MANY_ARGS record and its events
-- (type1, data1, ..., typeN, dataN). Reply: one APPEND reply per stream, in order
local out = {{}}
local a = 1
for k = 1, #KEYS, {len(APPEND_MANY_KEYS)} do
  local s, r = stream_keys(KEYS, k), stream_args(ARGV, a)
  local first = a + {len(APPEND_MANY_ARGS)}
  local n = tonumber(r.events)
  out[#out + 1] = append_one(s.meta, s.events, r.fence, r.channel, r.seq_before, r.seq_after, first,
    first + 2 * n - 1)
  a = first + 2 * n
end
return out
""")

# Closes: two terminal events (a zombie finishing after the new owner, or finish racing cancel-while-
# queued), and a terminal event without its status/usage/expiry/abort record (a crash between writes).
FINISH = Lua(PRELUDE + APPEND_EVENT + QUOTA_LUA + _RECORD_ABORT + RECORD_USAGE_LUA + BUDGET_LUA + HOOK_LUA + _CLOSE
             + """
-- K.stats, K.leases, K.backlog: the job's queue (broker.streams.keys.QueueKeys); A.ttft_ms: '' for none
local m = redis.call('HMGET', K.meta, 'fence', 'status', 'model', 'max_tokens', 'key_id', 'retention_s',
  'claimed_at', 'jid')
if m[1] == A.fence and ended(m[2]) then
  -- A retry of this very claim's finish whose reply was lost: the same answer again.
  return redis.call('HGET', K.meta, 'last_id')
end
if m[1] ~= A.fence or m[2] ~= 'running' then return false end
local model = m[3]
if A.model ~= '' then model = A.model end
redis.call('HSET', K.meta, 'model', model or '')
local now = server_ms() / 1000
local eid = close_stream(K.meta, K.events, K.tombstone, A.channel, A.type, A.data, A.status, A.usage,
  string.format('%.6f', now), tonumber(m[6] or '3600'))
-- Out of the queue: no lease to take over, and out of the backlog KEDA counts.
redis.call('ZREM', K.leases, A.sid)
if m[8] then redis.call('XDEL', K.backlog, m[8]) end
-- Queue statistics behind ETAs and Retry-After: running jobs, and a moving average of job time.
redis.call('HINCRBY', K.stats, 'busy', -1)
local took = math.max(0, now - tonumber(m[7] or now))
local ema = redis.call('HGET', K.stats, 'ema_job_s')
if ema then took = 0.8 * tonumber(ema) + 0.2 * took end
redis.call('HSET', K.stats, 'ema_job_s', string.format('%.6f', took))
record_usage(K.usage_index, A.usage_prefix, K.usage_rollups_since, K.meta, A.sid, A.status, A.reason, model,
  A.prompt_tokens, A.cached_tokens, A.completion_tokens, A.wasted_tokens, A.compute_s, A.ttft_ms)
budget_settle(K.meta, A.prompt_tokens, A.cached_tokens, A.completion_tokens)
hook_enqueue(K.outbox, K.outbox_dests, K.outbox_holds, K.meta, A.sid, A.status, A.reason)
if A.status ~= 'done' then
  record_abort(K.aborted_totals, A.reason, m[4], A.prompt_tokens, A.completion_tokens, A.compute_s)
end
return eid
""", key_names=("meta", "events", "usage_index", "stats", "leases", "backlog", "tombstone", "aborted_totals",
                "outbox", "outbox_dests", "outbox_holds", "usage_rollups_since"),
    arg_names=("fence", "channel", "type", "data", "status", "usage", "model", "reason", "prompt_tokens",
               "completion_tokens", "compute_s", "sid", "cached_tokens", "wasted_tokens", "ttft_ms", "usage_prefix"))

# Closes: cancel racing claim (a queued stream cancelled while a worker claims it: exactly one of them
# wins, and the loser sees the other's status) and two cancels racing (one terminal event).
CANCEL = Lua(PRELUDE + APPEND_EVENT + QUOTA_LUA + _RECORD_ABORT + RECORD_USAGE_LUA + BUDGET_LUA + HOOK_LUA + _CLOSE
             + QUEUE
             + REFUSE_WHEN_FULL + """
-- Reply: {'unknown'} | {'ended', status} (nothing to cancel) | {'cancelled'} (it was queued: now it ended)
--   | {'requested', status} (running: its worker stops it)
if redis.call('EXISTS', K.meta) == 0 then return {'unknown'} end
local m = redis.call('HMGET', K.meta, 'status', 'model', 'max_tokens', 'key_id', 'retention_s', 'qp', 'jid')
local st = m[1]
if ended(st) then return {'ended', st} end
if st == 'queued' then
  refuse_when_full(K.meta)  -- Redis full: refused whole (dequeue's first write, a ZREM, would let it all through)
  if redis.call('HGET', K.meta, 'held') ~= '1' then  -- a held turn is in no line yet
    dequeue(K.meta, A.sid, K.totals)
    if m[7] then redis.call('XDEL', queue_backlog(m[6]), m[7]) end
  end
  redis.call('HSET', K.meta, 'cancel', A.reason)
  close_stream(K.meta, K.events, K.tombstone, A.channel, 'cancelled', A.cancelled_data, 'cancelled', A.usage,
    string.format('%.6f', server_ms() / 1000), tonumber(m[5] or '3600'))
  record_usage(K.usage_index, A.usage_prefix, K.usage_rollups_since, K.meta, A.sid, 'cancelled', A.reason,
    m[2], 0, 0, 0, 0, 0, '')
  budget_settle(K.meta, 0, 0, 0)
  hook_enqueue(K.outbox, K.outbox_dests, K.outbox_holds, K.meta, A.sid, 'cancelled', A.reason)
  record_abort(K.aborted_totals, A.reason, m[3], 0, 0, 0)
  return {'cancelled'}
end
if not redis.call('HGET', K.meta, 'cancel') then redis.call('HSET', K.meta, 'cancel', A.reason) end
redis.call('PUBLISH', A.control_channel, A.sid)
return {'requested', st}
""", key_names=("meta", "events", "totals", "usage_index", "tombstone", "aborted_totals", "outbox", "outbox_dests",
                "outbox_holds", "usage_rollups_since"),
    arg_names=("reason", "channel", "cancelled_data", "usage", "control_channel", "sid", "usage_prefix"))

# Tokens an attempt computed and its stream will not hold (lease lost, job handed over), for its usage record.
WASTED = Lua(PRELUDE + """
local st = redis.call('HGET', K.meta, 'status')
if not st or ended(st) then return 0 end
return redis.call('HINCRBY', K.meta, 'wasted', A.tokens)
""", key_names=("meta",), arg_names=("tokens",))

# Records that a reader is connected (consumer pods call it every few seconds for each stream they
# serve), for any number of streams of one partition (one slot) in one call. Never creates a hash:
# touching an expired stream must not resurrect part of it. ``seen`` is the server's time, as RENEW's and the
# claim's abandonment checks that compare with it: a consumer pod's clock decides nothing.
TOUCH = Lua(SERVER_MS + """
-- KEYS: every stream's meta (one partition)
local now = string.format('%.3f', server_ms() / 1000)
for _, meta in ipairs(KEYS) do
  if redis.call('EXISTS', meta) == 1 then redis.call('HSET', meta, 'seen', now, 'read', 1) end
end
return 0
""")
