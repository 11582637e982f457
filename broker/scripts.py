"""The Lua scripts behind every multi-step change to a stream. Each runs atomically inside Redis.

Meta hash fields (``StreamKeys.meta``): ``status`` (queued|running|done|cancelled|error), ``rh``
(request hash), ``req`` (canonical request JSON), ``model``, ``max_tokens``, ``created_at``,
``jid`` (job entry id), ``fence`` (claim counter), ``attempts``, ``worker``, ``cancel`` (reason of a
pending cancel), ``last_id`` (terminal event id), ``usage`` (JSON), ``finished_at``, ``key_id``.

Every appended event is also PUBLISHed on the stream's live channel as ``<id>\\n<type>\\n<data>`` so
consumer pods can tail thousands of streams over one pub/sub connection; the stream stays the source of
truth (a pod that misses a message re-reads the range).
"""

from __future__ import annotations

# Closes: two creates with one id racing (double generation), and create racing the queue bound.
# EXISTS-then-HSET across round trips would let both callers see "absent" and both enqueue a job.
CREATE = """
-- KEYS: meta, events, jobs, qstats
-- ARGV: sid, rh, req, created_at, max_queue, model, max_tokens, channel, key_id, retention_s
if redis.call('EXISTS', KEYS[1]) == 1 then
  local m = redis.call('HMGET', KEYS[1], 'rh', 'status')
  if m[1] == ARGV[2] then return {0, m[2]} end
  return {-1, m[2]}
end
local waiting = tonumber(redis.call('HGET', KEYS[4], 'waiting') or '0')
local max_queue = tonumber(ARGV[5])
if max_queue > 0 and waiting >= max_queue then return {-3, tostring(waiting)} end
local jid = redis.call('XADD', KEYS[3], '*', 'sid', ARGV[1])
redis.call('HSET', KEYS[1], 'status', 'queued', 'rh', ARGV[2], 'req', ARGV[3], 'created_at', ARGV[4],
  'model', ARGV[6], 'max_tokens', ARGV[7], 'jid', jid, 'fence', 0, 'attempts', 0, 'key_id', ARGV[9],
  'retention_s', ARGV[10])
redis.call('HINCRBY', KEYS[4], 'waiting', 1)
local data = '{"position":' .. (waiting + 1) .. ',"eta_s":null}'
local eid = redis.call('XADD', KEYS[2], '*', 't', 'queued', 'd', data)
redis.call('PUBLISH', ARGV[8], eid .. '\\n' .. 'queued' .. '\\n' .. data)
return {1, 'queued'}
"""

# Closes: two workers claiming one job (a crashed worker's entry reclaimed while it wakes up), and a
# claim racing a cancel of a queued stream. The fence counter makes every earlier claimant a zombie
# whose appends the APPEND and FINISH scripts refuse.
CLAIM = """
-- KEYS: meta, qstats ; ARGV: worker, now_ms
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'done' or st == 'cancelled' or st == 'error' then return {-2} end
if st == 'queued' then redis.call('HINCRBY', KEYS[2], 'waiting', -1) end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
local fence = redis.call('HINCRBY', KEYS[1], 'fence', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1], 'claimed_at', ARGV[2])
local m = redis.call('HMGET', KEYS[1], 'req', 'cancel', 'model', 'seq', 'jid')
return {fence, attempts, m[1], m[2] or '', m[3] or '', m[4] or '0', m[5]}
"""

# Closes: a zombie (a worker that lost its lease) appending after the new owner, and an append landing
# after the terminal event. Fence and status are checked in the same step as the XADD. ``seq`` (the
# number of tokens appended so far) makes a retried append whose first reply was lost a no-op, not a
# duplicate: the caller sees {-2, current seq} and knows whether its batch landed.
APPEND = """
-- KEYS: meta, events ; ARGV: fence, channel, seq_before, seq_after, type1, data1, type2, data2, ...
local m = redis.call('HMGET', KEYS[1], 'fence', 'status', 'cancel', 'seq')
if m[1] ~= ARGV[1] or m[2] ~= 'running' then return {-1, m[3] or ''} end
if (m[4] or '0') ~= ARGV[3] then return {-2, m[4] or '0'} end
redis.call('HSET', KEYS[1], 'seq', ARGV[4])
for i = 5, #ARGV, 2 do
  local eid = redis.call('XADD', KEYS[2], '*', 't', ARGV[i], 'd', ARGV[i + 1])
  redis.call('PUBLISH', ARGV[2], eid .. '\\n' .. ARGV[i] .. '\\n' .. ARGV[i + 1])
end
return {0, m[3] or ''}
"""

# Closes: two terminal events (a zombie finishing after the new owner, or finish racing cancel-while-
# queued), and the terminal event without its status/usage/expiry (a crash between separate writes).
FINISH = """
-- KEYS: meta, events, aborted
-- ARGV: fence, channel, type, data, status, usage, model, now_s,
--       reason, prompt_tokens, completion_tokens, compute_s
local m = redis.call('HMGET', KEYS[1], 'fence', 'status', 'model', 'max_tokens', 'key_id', 'retention_s')
if m[1] ~= ARGV[1] or m[2] ~= 'running' then return false end
local eid = redis.call('XADD', KEYS[2], '*', 't', ARGV[3], 'd', ARGV[4])
redis.call('PUBLISH', ARGV[2], eid .. '\\n' .. ARGV[3] .. '\\n' .. ARGV[4])
if ARGV[7] ~= '' then m[3] = ARGV[7] end
redis.call('HSET', KEYS[1], 'status', ARGV[5], 'usage', ARGV[6], 'last_id', eid, 'finished_at', ARGV[8],
  'model', m[3] or '')
redis.call('HDEL', KEYS[1], 'worker')
local retention = tonumber(m[6] or '3600')
redis.call('EXPIRE', KEYS[1], retention)
redis.call('EXPIRE', KEYS[2], retention)
if ARGV[5] ~= 'done' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', 1000000, '*', 'sid', string.match(KEYS[1], ':s:([^:]+):meta$'),
    'ts', ARGV[8], 'status', ARGV[5], 'reason', ARGV[9], 'model', m[3] or '', 'max_tokens', m[4] or '0',
    'prompt_tokens', ARGV[10], 'completion_tokens', ARGV[11], 'compute_s', ARGV[12], 'key_id', m[5] or '')
end
return eid
"""

# Closes: cancel racing claim (a queued stream cancelled while a worker claims it: exactly one of them
# wins, and the loser sees the other's status) and two cancels racing (one terminal event).
CANCEL = """
-- KEYS: meta, events, qstats, aborted
-- ARGV: reason, channel, cancelled_data, usage, now_s, control_channel, sid
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, ''} end
local m = redis.call('HMGET', KEYS[1], 'status', 'model', 'max_tokens', 'key_id', 'retention_s')
local st = m[1]
if st == 'done' or st == 'cancelled' or st == 'error' then return {0, st} end
if st == 'queued' then
  local eid = redis.call('XADD', KEYS[2], '*', 't', 'cancelled', 'd', ARGV[3])
  redis.call('PUBLISH', ARGV[2], eid .. '\\n' .. 'cancelled' .. '\\n' .. ARGV[3])
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'usage', ARGV[4], 'last_id', eid, 'finished_at', ARGV[5],
    'cancel', ARGV[1])
  redis.call('HINCRBY', KEYS[3], 'waiting', -1)
  local retention = tonumber(m[5] or '3600')
  redis.call('EXPIRE', KEYS[1], retention)
  redis.call('EXPIRE', KEYS[2], retention)
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', 1000000, '*', 'sid', ARGV[7], 'ts', ARGV[5], 'status', 'cancelled',
    'reason', ARGV[1], 'model', m[2] or '', 'max_tokens', m[3] or '0', 'prompt_tokens', 0,
    'completion_tokens', 0, 'compute_s', 0, 'key_id', m[4] or '')
  return {1, 'cancelled'}
end
if not redis.call('HGET', KEYS[1], 'cancel') then redis.call('HSET', KEYS[1], 'cancel', ARGV[1]) end
redis.call('PUBLISH', ARGV[6], ARGV[7])
return {2, st}
"""

# Keeps a running job's queue entry fresh, so XAUTOCLAIM by other workers (min idle = lease) only takes
# jobs whose owner stopped renewing. Refused for a fenced-out owner, which then stops generating.
RENEW = """
-- KEYS: meta, jobs ; ARGV: fence, group, worker, jid
local m = redis.call('HMGET', KEYS[1], 'fence', 'status', 'cancel')
if m[1] ~= ARGV[1] or m[2] ~= 'running' then return {-1, ''} end
redis.call('XCLAIM', KEYS[2], ARGV[2], ARGV[3], 0, ARGV[4], 'JUSTID')
return {0, m[3] or ''}
"""
