"""The job queue's Lua: how a job waits, is claimed, kept, handed back and taken over. Each script is atomic.

A model's queue in one partition (broker.streams.keys.QueueKeys) holds:
- per tier, a ring of the tenants with queued jobs and, per tenant, the list of its queued jobs (stream ids). A
  claim serves the first tier with work (``priority``, ``default``, ``flex``), unless a lower one has waited
  ``aging_ms`` since a claim last served it (then that one: broker.request.tiers), takes the next job of the tenant at
  the ring's head and moves that tenant to the tail. Tenants take turns: a tenant's backlog delays another's job
  by about one job per tenant ahead of it in the ring, never by the backlog's length.
- ``leases``: the running jobs, each scored by when its lease ends. A worker renews its lease while it runs the
  job (RENEW); a lease in the past (a worker that died, or handed the job back: score 0) is taken over by the
  next claim, which fences the earlier owner out.
- ``deferred`` and one inbox per worker (chat-affine claiming): a claim that meets a job whose chat another
  worker ran last, while the job is younger than ``affinity_wait_ms``, leaves it in that worker's inbox (and
  wakes it); any claim takes it once its wait is over, so a dead owner strands nothing.
- ``wake`` tokens (one per enqueue) an idle worker blocks on, and the ``backlog`` stream KEDA counts.

A stream's meta (broker.streams.scripts) says where its job is: ``qp`` (its queue's key prefix), ``tier``, ``who``
(its tenant), ``jid`` (its backlog entry), ``aff`` (its chat's affinity digest). The scripts name the per-tenant
lists and the waiting streams' keys from those, inside Lua, with builders generated from broker.streams.keys
(``QUEUE_KEYS``): every one shares the partition's hash tag, so each script stays in one slot on Redis Cluster.

Positions: each claim tells the first ``position_updates`` jobs still waiting their new place in the order the
claims will take them (tiers in order, tenants in turn; aging and affinity aside), so the ``queued`` events
count down under the same policy the claims follow. A create computes its own job's place the same way.
"""

from __future__ import annotations

from broker.redis.connection import ALLOW_WHEN_FULL, REFUSE_WHEN_FULL
from broker.redis.keyspace import lua_builders
from broker.redis.lua import SERVER_MS, Lua
from broker.request.tiers import TIERS
from broker.streams.keys import (
    AFFINITY,
    QUEUE_BACKLOG,
    QUEUE_DEFERRED,
    QUEUE_INBOX,
    QUEUE_LEASES,
    QUEUE_RING,
    QUEUE_STATS,
    QUEUE_WAITING,
    QUEUE_WAKE,
    QUEUE_WAKE_FOR,
    STREAM_CHANNEL,
    STREAM_EVENTS,
    STREAM_META,
)
from broker.streams.lua import APPEND_EVENT, PRELUDE

#: Wake tokens kept per queue: enough for a burst of creates to wake every idle worker, few enough to be nothing.
WAKE_TOKENS = 64
#: Jobs an inbox holds (an owner that died leaves its inbox to expire: stale entries are skipped).
INBOX_MAX = 1000
INBOX_TTL_S = 86400
#: Jobs a claim looks at before it gives up for this call (each one it passes was left for its chat's worker).
CLAIM_TRIES = 8


def _lua_list(values: tuple[str, ...]) -> str:
    return "{" + ", ".join(f"'{v}'" for v in values) + "}"


#: The Lua builders of the keys the queue's scripts name themselves (from a stream's ``qp``, the partition's stream
#: prefix, the affinities' prefix): generated from broker.streams.keys, the one place each key is spelled.
QUEUE_KEYS = lua_builders(
    queue_stats=QUEUE_STATS, queue_backlog=QUEUE_BACKLOG, queue_leases=QUEUE_LEASES, queue_deferred=QUEUE_DEFERRED,
    queue_wake=QUEUE_WAKE, queue_wake_for=QUEUE_WAKE_FOR, queue_inbox=QUEUE_INBOX, ring_of=QUEUE_RING,
    tenant_list=QUEUE_WAITING, stream_meta=STREAM_META, stream_events=STREAM_EVENTS, stream_channel=STREAM_CHANNEL,
    affinity_key=AFFINITY)

#: What the queue's scripts share: putting a job in line and taking it out, counting, the service order, and
#: claiming one stream. Defined after PRELUDE and APPEND_EVENT (which it uses).
QUEUE = SERVER_MS + QUEUE_KEYS + f"""
local TIERS = {_lua_list(TIERS)}
local WAKE_TOKENS, INBOX_MAX, INBOX_TTL_S = {WAKE_TOKENS}, {INBOX_MAX}, {INBOX_TTL_S}

local function wake(list)
  redis.call('RPUSH', list, '1')
  redis.call('LTRIM', list, -WAKE_TOKENS, -1)
  redis.call('EXPIRE', list, INBOX_TTL_S)
end

-- Counts of waiting jobs: the model queue's (all tiers, per tier) and the partition's over every model.
local function count_waiting(qp, tier, totals, delta)
  redis.call('HINCRBY', queue_stats(qp), 'waiting', delta)
  redis.call('HINCRBY', queue_stats(qp), 'waiting:' .. tier, delta)
  redis.call('HINCRBY', totals, 'waiting', delta)
end

-- Into its tenant's line (at the front: a job given back unstarted), the tenant into the tier's ring if it was not
-- there (the ring holds a tenant exactly while its list is not empty), and one worker woken.
local function enqueue(qp, tier, who, sid, totals, now_ms, front)
  local ring = ring_of(qp, tier)
  if redis.call('LLEN', ring) == 0 then
    -- The tier starts waiting now: its age (broker.request.tiers) counts from here, not from its last claim long ago.
    redis.call('HSET', queue_stats(qp), 'served:' .. tier, now_ms)
  end
  local n
  if front then n = redis.call('LPUSH', tenant_list(qp, tier, who), sid)
  else n = redis.call('RPUSH', tenant_list(qp, tier, who), sid) end
  if n == 1 then
    if front then redis.call('LPUSH', ring, who) else redis.call('RPUSH', ring, who) end
  end
  count_waiting(qp, tier, totals, 1)
  wake(queue_wake(qp))
end

-- Out of line (a cancel, or a claim naming the stream), wherever it waits: its tenant's list, or left for a worker.
local function dequeue(meta, sid, totals)
  local m = redis.call('HMGET', meta, 'qp', 'tier', 'who')
  local qp, tier, who = m[1], m[2], m[3]
  if redis.call('ZREM', queue_deferred(qp), sid) == 0 then
    local list = tenant_list(qp, tier, who)
    redis.call('LREM', list, 1, sid)
    if redis.call('LLEN', list) == 0 then redis.call('LREM', ring_of(qp, tier), 0, who) end
  end
  count_waiting(qp, tier, totals, -1)
end

-- The next ``count`` waiting jobs in the order claims take them: tiers in order, tenants in turn. Bounded: a
-- round reads at most ``count`` tenants' heads, and the order stops at ``count`` jobs.
local function service_order(qp, count)
  local out = {{}}
  for _, tier in ipairs(TIERS) do
    local ring = redis.call('LRANGE', ring_of(qp, tier), 0, count - 1)
    local lines = {{}}
    for i, who in ipairs(ring) do lines[i] = redis.call('LRANGE', tenant_list(qp, tier, who), 0, count - 1) end
    local round, more = 1, #ring > 0
    while more and #out < count do
      more = false
      for i = 1, #ring do
        local sid = lines[i][round]
        if sid then
          more = true
          out[#out + 1] = sid
          if #out >= count then break end
        end
      end
      round = round + 1
    end
    if #out >= count then break end
  end
  return out
end

-- The place a new job of ``who`` in ``tier`` will have (1-based), before it is enqueued: every job of the tiers
-- before, then, in its own, the rounds its tenant's earlier jobs take (each other tenant adds at most one job a
-- round). Tenants past the first ``count`` of the ring are estimated from the tier's count.
local function new_position(qp, tier, who, count)
  local stats = queue_stats(qp)
  local ahead = 0
  for _, t in ipairs(TIERS) do
    if t == tier then break end
    ahead = ahead + tonumber(redis.call('HGET', stats, 'waiting:' .. t) or '0')
  end
  local mine = redis.call('LLEN', tenant_list(qp, tier, who))
  local ring_qp = ring_of(qp, tier)
  local counted = mine
  local others = 0
  for _, u in ipairs(redis.call('LRANGE', ring_qp, 0, count - 1)) do
    if u ~= who then
      local n = redis.call('LLEN', tenant_list(qp, tier, u))
      counted = counted + n
      others = others + math.min(n, mine + 1)
    end
  end
  local rest = tonumber(redis.call('HGET', stats, 'waiting:' .. tier) or '0') - counted
  local unseen = redis.call('LLEN', ring_qp) - count
  if rest > 0 and unseen > 0 then others = others + math.min(rest, unseen * (mine + 1)) end
  return ahead + others + mine + 1
end

local function eta_of(position, stats)
  local q = redis.call('HMGET', stats, 'ema_job_s', 'busy')
  if not q[1] then return 'null' end
  return string.format('%.3f', position * tonumber(q[1]) / math.max(1, tonumber(q[2] or '1')))
end

-- ``workers``: the generators serving the model as its create saw them (only a create says: a claim's position
-- updates come from a worker); nil or '' leaves the field out.
local function queued_data(position, stats, workers)
  local w = ''
  if workers and workers ~= '' then w = ',"workers":' .. workers end
  return '{{"position":' .. position .. ',"eta_s":' .. eta_of(position, stats) .. w .. '}}'
end

-- Tell the first ``count`` waiting jobs their place (``streams``: the partition's stream prefix).
local function refresh_positions(qp, count, streams)
  for pos, sid in ipairs(service_order(qp, count)) do
    append_event(stream_events(streams, sid), stream_channel(streams, sid), 'queued', queued_data(pos, queue_stats(qp)))
  end
end

-- The reply of a claim (claim_stream's; CLAIM_NEXT's again, for a retry whose first reply was lost).
local function claim_reply(meta, sid, fence, attempts, tier, claimed_at)
  local r = redis.call('HMGET', meta, 'req', 'cancel', 'model', 'seq', 'tenant', 'created_at', 'tp')
  return {{'claimed', sid, fence, attempts, r[1], r[2] or '', r[3] or '', r[4] or '0', r[5] or '', tier,
    r[6] or claimed_at, claimed_at, r[7] or ''}}
end

-- Claim one stream for ``worker`` (its job out of line already, or running under a lapsed lease): every earlier
-- claimant is fenced out. ``now_s``/``now_ms``: the server's time (so are ``created_at`` and ``seen``: CREATE, TOUCH).
-- Reply: {{'claimed', sid, fence, attempts, req, cancel, model, seq, tenant key, tier, created_at, claimed_at (both
-- server time, s), traceparent ('': not traced)}}.
local function claim_stream(meta, sid, worker, now_s, now_ms, lease_ms, was_queued)
  local m = redis.call('HMGET', meta, 'qp', 'tier')
  local qp, tier = m[1], m[2]
  if was_queued then
    redis.call('HINCRBY', queue_stats(qp), 'busy', 1)
    redis.call('HSET', queue_stats(qp), 'served:' .. tier, now_ms)
  end
  local attempts = redis.call('HINCRBY', meta, 'attempts', 1)
  local fence = redis.call('HINCRBY', meta, 'fence', 1)
  redis.call('HSET', meta, 'status', 'running', 'worker', worker, 'claimed_at', now_s)
  redis.call('HSETNX', meta, 'started_at', now_s)  -- the first claim's: the job's wait ends there (its usage record)
  local a = redis.call('HMGET', meta, 'abandon_s', 'seen', 'cancel')
  local now = tonumber(now_s)
  if not a[3] and tonumber(a[1] or '0') > 0 and now - tonumber(a[2] or now) > tonumber(a[1]) then
    redis.call('HSET', meta, 'cancel', 'abandoned')
  end
  redis.call('ZADD', queue_leases(qp), now_ms + lease_ms, sid)
  return claim_reply(meta, sid, fence, attempts, tier, now_s)
end
"""

_HEAD = PRELUDE + APPEND_EVENT + QUEUE + REFUSE_WHEN_FULL

# Closes: two workers taking one job (each job leaves its line, or its lapsed lease, in the one step that claims
# it), a claim racing a cancel (the cancel takes it out of line in its own step: a claim never sees it), and a
# takeover racing a slow owner's renewal (the fence decides). A worker that finds nothing learns how long it may
# sleep before a lease or a left job falls due.
CLAIM_NEXT = Lua(_HEAD + """
local now_ms = server_ms()
local now_s = string.format('%.6f', now_ms / 1000)
local qp = A.qp
local function meta_of(sid) return stream_meta(A.stream_prefix, sid) end
-- Asked again with the token of a claim whose reply never reached the worker (redis-py's retry of a call cut
-- after the script ran, or the worker's next try of this queue): the stream it claimed then, while still its.
local receipt = redis.call('HMGET', K.receipt, 'token', 'sid', 'fence')
if receipt[1] == A.token then
  local meta = meta_of(receipt[2])
  local m = redis.call('HMGET', meta, 'status', 'worker', 'fence', 'attempts', 'tier', 'claimed_at')
  if m[1] == 'running' and m[2] == A.worker and m[3] == receipt[3] then
    redis.call('ZADD', K.leases, 'XX', now_ms + tonumber(A.lease_ms), receipt[2])
    return claim_reply(meta, receipt[2], m[3], m[4], m[5], m[6] or now_s)
  end
end
-- Redis full: no claim (its first write, an LPOP, would let every later one through; the job would start and
-- stall at its first append). Refused before anything is written.
refuse_when_full(K.stats)
local function done(reply)
  if reply[1] == 'claimed' then
    redis.call('HSET', K.receipt, 'token', A.token, 'sid', reply[2], 'fence', reply[3])
    redis.call('PEXPIRE', K.receipt, A.lease_ms)
    refresh_positions(qp, tonumber(A.position_updates), A.stream_prefix)
  end
  return reply
end
-- A left job, taken out of ``deferred`` (by the caller) and claimed, if it still waits (nil: a cancel took it).
local function claim_left(sid)
  local meta = meta_of(sid)
  if redis.call('HGET', meta, 'status') ~= 'queued' then return nil end
  count_waiting(qp, redis.call('HGET', meta, 'tier'), K.totals, -1)
  return done(claim_stream(meta, sid, A.worker, now_s, now_ms, tonumber(A.lease_ms), true))
end
-- What other workers left for this one (its chat's prefix is here), while it is still left.
while true do
  local sid = redis.call('LPOP', K.inbox)
  if not sid then break end
  if redis.call('ZREM', K.deferred, sid) == 1 then
    local reply = claim_left(sid)
    if reply then return reply end
  end
end
-- A lapsed lease: its worker died, or gave the job back.
for _, sid in ipairs(redis.call('ZRANGEBYSCORE', K.leases, '-inf', now_ms, 'LIMIT', 0, 4)) do
  local meta = meta_of(sid)
  local st = redis.call('HGET', meta, 'status')
  if st == 'running' then
    return done(claim_stream(meta, sid, A.worker, now_s, now_ms, tonumber(A.lease_ms), false))
  end
  redis.call('ZREM', K.leases, sid)  -- ended (or gone) under a lapsed lease: nothing to take over
end
-- A job left for a chat's worker whose wait is over.
for _, sid in ipairs(redis.call('ZRANGEBYSCORE', K.deferred, '-inf', now_ms, 'LIMIT', 0, 1)) do
  redis.call('ZREM', K.deferred, sid)
  local reply = claim_left(sid)
  if reply then return reply end
end
-- The lines: a tier (broker.request.tiers), then tenants in turn.
local aging = tonumber(A.aging_ms)
local wait_ms = tonumber(A.affinity_wait_ms)
for _ = 1, tonumber(A.tries) do
  local tier = nil
  for _, t in ipairs(TIERS) do
    if redis.call('LLEN', ring_of(qp, t)) > 0 then
      if not tier then
        tier = t
      elseif aging > 0 and now_ms - tonumber(redis.call('HGET', K.stats, 'served:' .. t) or now_ms) >= aging then
        tier = t  -- waited too long behind the tiers before it
        break
      end
    end
  end
  if not tier then break end
  local ring = ring_of(qp, tier)
  local who = redis.call('LMOVE', ring, ring, 'LEFT', 'RIGHT')
  local line = tenant_list(qp, tier, who)
  local sid = redis.call('LPOP', line)
  if redis.call('LLEN', line) == 0 then redis.call('LREM', ring, -1, who) end
  if sid then
    local meta = meta_of(sid)
    local m = redis.call('HMGET', meta, 'status', 'aff', 'created_at')
    if m[1] ~= 'queued' then
      count_waiting(qp, tier, K.totals, -1)  -- a stream lost while it waited (evicted): out of the counts
    else
      local owner = nil
      if wait_ms > 0 and m[2] and m[2] ~= '' then owner = redis.call('GET', affinity_key(A.affinity_prefix, m[2])) end
      local left = 0
      if owner and owner ~= A.worker then left = wait_ms - (now_ms - math.floor(tonumber(m[3]) * 1000)) end
      if left > 0 then
        -- Left for the worker holding the chat's prefix, which is woken; anyone's after ``left``.
        redis.call('ZADD', K.deferred, now_ms + left, sid)
        local inbox = queue_inbox(qp, owner)
        redis.call('RPUSH', inbox, sid)
        redis.call('LTRIM', inbox, -INBOX_MAX, -1)
        redis.call('EXPIRE', inbox, INBOX_TTL_S)
        wake(queue_wake_for(qp, owner))
      else
        count_waiting(qp, tier, K.totals, -1)
        return done(claim_stream(meta, sid, A.worker, now_s, now_ms, tonumber(A.lease_ms), true))
      end
    end
  end
end
-- Nothing now: how long until a lease or a left job falls due (ms; '' for nothing due).
local due = nil
for _, z in ipairs({K.leases, K.deferred}) do
  local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
  if first[2] then
    local d = math.max(0, tonumber(first[2]) - now_ms)
    if not due or d < due then due = d end
  end
end
return {'empty', due and tostring(due) or ''}
""", key_names=("totals", "stats", "leases", "deferred", "inbox", "receipt"),
    arg_names=("qp", "worker", "token", "lease_ms", "aging_ms", "affinity_wait_ms", "affinity_prefix", "tries",
               "stream_prefix", "position_updates"))

# One named stream claimed, wherever its job is (waiting in line, left for a worker, or running under any lease):
# what a stand-in writer (tests, bench) does; the same fencing as CLAIM_NEXT.
CLAIM = Lua(_HEAD + """
if redis.call('EXISTS', K.meta) == 0 then return {'gone'} end
local st = redis.call('HGET', K.meta, 'status')
if ended(st) then return {'finished'} end
if redis.call('HGET', K.meta, 'held') == '1' then return {'held'} end  -- it waits for its conversation's turn
refuse_when_full(K.meta)
local now_ms = server_ms()
local queued = st == 'queued'
if queued then dequeue(K.meta, A.sid, K.totals) end
local reply = claim_stream(K.meta, A.sid, A.worker, string.format('%.6f', now_ms / 1000), now_ms,
  tonumber(A.lease_ms), queued)
if queued then
  refresh_positions(redis.call('HGET', K.meta, 'qp'), tonumber(A.position_updates), A.stream_prefix)
end
return reply
""", key_names=("meta", "totals"),
    arg_names=("sid", "worker", "lease_ms", "stream_prefix", "position_updates"))

# Keeps a running job's lease, so no claim takes it over while its worker lives. Refused for a fenced-out owner,
# which then stops generating. Also where nobody-is-reading turns into a cancel: a stream unread for abandon_s, or
# (cancel_on_disconnect) read once and then left without a reader for disconnect_grace_s.
RENEW = Lua(SERVER_MS + ALLOW_WHEN_FULL + """
-- Reply: {'renewed', cancel reason or ''} | {'fenced'}
local m = redis.call('HMGET', K.meta, 'fence', 'status', 'cancel', 'abandon_s', 'cod', 'read', 'seen')
if m[1] ~= A.fence or m[2] ~= 'running' then return {'fenced'} end
allow_when_full(K.leases)  -- a new deadline takes no memory: kept through an out-of-memory episode
local now_ms = server_ms()
redis.call('ZADD', K.leases, 'XX', now_ms + tonumber(A.lease_ms), A.sid)
if m[3] then return {'renewed', m[3]} end
-- Both times are the server's (``seen``: TOUCH, CREATE): a worker pod's clock decides no abandonment.
local now = now_ms / 1000
local seen = tonumber(m[7] or now)
local reason = ''
if tonumber(m[4] or '0') > 0 and now - seen > tonumber(m[4]) then
  reason = 'abandoned'
elseif m[5] == '1' and m[6] == '1' and now - seen > tonumber(A.disconnect_grace_s) then
  reason = 'disconnect'
end
if reason ~= '' then redis.call('HSET', K.meta, 'cancel', reason) end
return {'renewed', reason}
""", key_names=("meta", "leases"), arg_names=("fence", "sid", "lease_ms", "disconnect_grace_s"))

# Hands a running job over at once (a worker stopping past its grace period): its lease lapses now, one idle
# worker is woken, and the next claim takes it over (fencing this worker out).
RELEASE = Lua(ALLOW_WHEN_FULL + f"local WAKE_TOKENS = {WAKE_TOKENS}\n" + """
local m = redis.call('HMGET', K.meta, 'fence', 'status')
if m[1] ~= A.fence or m[2] ~= 'running' then return 0 end
allow_when_full(K.leases)
redis.call('ZADD', K.leases, 'XX', 0, A.sid)
redis.call('RPUSH', K.wake, '1')
redis.call('LTRIM', K.wake, -WAKE_TOKENS, -1)
return 1
""", key_names=("meta", "leases", "wake"), arg_names=("fence", "sid"))

# Gives back a job claimed and not started (the worker's slot went to a parked generation meanwhile): back at the
# front of its tenant's line, queued again, as if never claimed. A job some attempt had started (it holds events
# past the claim) is handed over instead, to be continued.
GIVE_BACK = Lua(PRELUDE + QUEUE + """
local m = redis.call('HMGET', K.meta, 'fence', 'status', 'seq', 'qp', 'tier', 'who', 'attempts')
if m[1] ~= A.fence or m[2] ~= 'running' then return 0 end
local qp = m[4]
if (m[3] or '0') ~= '0' or tonumber(m[7]) > 1 then
  redis.call('ZADD', queue_leases(qp), 'XX', 0, A.sid)
  wake(queue_wake(qp))
  return 1
end
redis.call('ZREM', queue_leases(qp), A.sid)
redis.call('HINCRBY', queue_stats(qp), 'busy', -1)
redis.call('HINCRBY', K.meta, 'attempts', -1)
redis.call('HSET', K.meta, 'status', 'queued')
redis.call('HDEL', K.meta, 'worker', 'claimed_at', 'started_at')  -- never claimed: its wait goes on
enqueue(qp, m[5], m[6], A.sid, K.totals, server_ms(), true)
return 1
""", key_names=("meta", "totals"), arg_names=("fence", "sid"))
