"""The Lua scripts of conversations (broker.streams.conversations), each with the race it closes.

Meta hash fields (``ConversationKeys.meta``): ``created_at`` (Unix s), ``ttl_s`` (the sliding expiry),
``version`` (bumped when history is rewritten: a branch), ``turns`` (how many finished turns the list holds),
``bytes`` (their records' size), ``pending`` (the stream id of the turn that runs, or is being created; '' =
none), ``pending_at`` (when it was reserved, Unix ms, the server's clock), ``owner`` (the key of the owner's
set, ``ConversationKeys.owner``), ``metadata`` (JSON: OpenAI's 16 key-value pairs).

Every script runs in the conversation's slot (its keys share a hash tag, the owner's set included: the owner
key a script reads from ``owner`` is in the same partition). None touches a turn's stream, which lives in
another slot: TAKE is the one script on the stream's side, and it touches only that stream's keys.

Every script that finds the conversation refreshes its sliding expiry (``touch``): the meta, the turns and
the conversation's score in its owner's set (which itself lives as long as its longest-lived member).
"""

from __future__ import annotations

from broker.redis.quota import QUOTA_LUA

# Shared Lua: the sliding expiry and the owner's count, refreshed on every use; and the conversation's charge
# against its owner's storage quota (broker.redis.quota: meta ``qs``), kept equal to its ``bytes`` and expiring
# with it.
_TOUCH = QUOTA_LUA + """
local function now_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
local function touch(meta, turns, digest)
  local m = redis.call('HMGET', meta, 'ttl_s', 'owner', 'qs', 'bytes')
  local ttl = tonumber(m[1] or '0')
  if m[3] then
    local delta = tonumber(m[4] or '0') - tonumber(redis.call('HGET', m[3], meta) or '0')
    if delta ~= 0 then quota_charge(m[3], meta, delta) end
    if ttl > 0 then quota_expire(m[3], meta, string.format('%d', now_ms() + ttl * 1000)) end
  end
  if ttl <= 0 then return end
  redis.call('EXPIRE', meta, ttl)
  if redis.call('EXISTS', turns) == 1 then redis.call('EXPIRE', turns, ttl) end
  if m[2] then
    redis.call('ZADD', m[2], now_ms() + ttl * 1000, digest)
    if redis.call('PTTL', m[2]) < ttl * 1000 then redis.call('PEXPIRE', m[2], ttl * 1000) end
  end
end
"""

# Shared Lua: a new conversation, counted against its owner's limit in the same step (a count read in one
# round trip and incremented in another would let a flood of creates through past it). Expired members are
# dropped from the owner's set first: their keys expired by themselves.
_OPEN = """
local function open(meta, turns, owner, digest, ttl, max_count, created_at, metadata, storage)
  quota_sweep(storage)  -- first: a full Redis refuses the script here, before ZREMRANGEBYSCORE lets writes by
  local now = now_ms()
  redis.call('ZREMRANGEBYSCORE', owner, '-inf', now)
  if max_count > 0 and redis.call('ZCARD', owner) >= max_count then return false end
  redis.call('HSET', meta, 'created_at', created_at, 'ttl_s', ttl, 'version', 0, 'turns', 0, 'bytes', 0,
    'pending', '', 'pending_at', 0, 'owner', owner, 'metadata', metadata, 'qs', storage)
  return true
end
"""

# Reads a conversation: its meta and (ARGV[2] = 1) every finished turn, in one step, so the turns are those
# the meta counts. Reading is using: it restarts the sliding expiry.
# Reply: {} (no such conversation) or {created_at, version, turns, bytes, pending, pending age ms, metadata,
# turn records...}.
READ = _TOUCH + """
-- KEYS: meta, turns ; ARGV: digest, with_turns
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
touch(KEYS[1], KEYS[2], ARGV[1])
local m = redis.call('HMGET', KEYS[1], 'created_at', 'version', 'turns', 'bytes', 'pending', 'pending_at', 'metadata')
local age = 0
if m[5] and m[5] ~= '' then age = now_ms() - tonumber(m[6] or '0') end
local out = {m[1] or '0', m[2] or '0', m[3] or '0', m[4] or '0', m[5] or '', tostring(age), m[7] or '{}'}
if ARGV[2] == '1' then
  for _, t in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do out[#out + 1] = t end
end
return out
"""

# Closes: two creates of one conversation id at once (OpenAI's POST /v1/conversations makes ids, but rsb's
# native creates name their own). Initial turns (items) are stored with it. Reply: {'reserved'} (made),
# {'exists'}, {'full'} (the owner holds as many as it may), {'quota'} (the items do not fit the owner's storage quota).
CREATE = _TOUCH + _OPEN + """
-- KEYS: meta, turns, owner, storage ; ARGV: digest, ttl_s, max_conversations, created_at, metadata, storage quota
--   (this partition's share; 0: none), turn records...
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
local size = 0
for i = 7, #ARGV do size = size + #ARGV[i] end
quota_sweep(KEYS[4])
if not quota_room(KEYS[4], size, tonumber(ARGV[6])) then return {'quota'} end
if not open(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5],
    KEYS[4]) then
  return {'full'}
end
for i = 7, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('HSET', KEYS[1], 'turns', #ARGV - 6, 'bytes', size)
touch(KEYS[1], KEYS[2], ARGV[1])
return {'reserved'}
"""

# Closes: two devices starting the next turn at once (one turn, and a conflict for the other), and a turn
# started on a history that changed since its request read it (a turn folded in, a branch): its prompt would
# be built on turns that are no longer the conversation's. The turn is reserved here, in the conversation's
# slot, by the stream id it will have; the stream is created next, in its own slot. A reservation whose stream
# never came (the creating process died in between) is taken back by TAKE, then RELEASE.
# ARGV version/turns: what the request read (0, 0 and a missing conversation: create it, as the native
# create does for a conversation id it has not seen).
# Reply (broker.streams.conversations.Begin): {'reserved'}, {'already'} (reserved for this stream: a retry),
# {'busy', pending} (another turn is pending), {'changed'} (the history changed), {'gone'} (no such
# conversation), {'full'} (the owner holds as many as it may).
BEGIN = _TOUCH + _OPEN + """
-- KEYS: meta, turns, owner, storage ; ARGV: digest, version, turns, sid, ttl_s, max_conversations, created_at,
--   create
if redis.call('EXISTS', KEYS[1]) == 0 then
  if ARGV[8] ~= '1' or ARGV[2] ~= '0' or ARGV[3] ~= '0' then return {'gone'} end
  if not open(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], '{}',
      KEYS[4]) then
    return {'full'}
  end
end
local m = redis.call('HMGET', KEYS[1], 'pending', 'version', 'turns')
if m[1] == ARGV[4] then
  touch(KEYS[1], KEYS[2], ARGV[1])
  return {'already'}
end
if m[1] and m[1] ~= '' then return {'busy', m[1]} end
if m[2] ~= ARGV[2] or m[3] ~= ARGV[3] then return {'changed'} end
redis.call('HSET', KEYS[1], 'pending', ARGV[4], 'pending_at', now_ms())
touch(KEYS[1], KEYS[2], ARGV[1])
return {'reserved'}
"""

# Closes: a turn's output landing twice (the worker that finished it, a pod that read the conversation and
# found it ended, a retry whose reply was lost: all fold the same record, built from the stream's events) or
# landing in a conversation that moved on (deleted, or a reservation taken back). Only the pending turn
# folds, and folding clears it in the same step: exactly once. Never creates a conversation.
FOLD = _TOUCH + """
-- KEYS: meta, turns ; ARGV: digest, sid, turn record
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HGET', KEYS[1], 'pending') ~= ARGV[2] then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('HINCRBY', KEYS[1], 'turns', 1)
redis.call('HINCRBY', KEYS[1], 'bytes', #ARGV[3])
redis.call('HSET', KEYS[1], 'pending', '', 'pending_at', 0)
touch(KEYS[1], KEYS[2], ARGV[1])
return 1
"""

# Clears a reservation, only if it is still this stream's: a create that was refused (the queue was full,
# the id was taken) or a reservation taken back (TAKE) never clears a newer one.
RELEASE = """
-- KEYS: meta ; ARGV: sid
if redis.call('HGET', KEYS[1], 'pending') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'pending', '', 'pending_at', 0)
return 1
"""

# Closes: a turn started (reserved) while the history is rewritten under it, and two rewrites at once. Keeps
# the first ``keep`` turns (the AI SDK's regenerate and edit continue from an earlier turn) and bumps the
# version, so that requests built on the old history fail BEGIN's check.
# Reply: {'reserved', new version}, {'busy', pending}, {'changed'}, {'gone'}.
BRANCH = _TOUCH + """
-- KEYS: meta, turns ; ARGV: digest, version, turns, keep
if redis.call('EXISTS', KEYS[1]) == 0 then return {'gone'} end
local m = redis.call('HMGET', KEYS[1], 'pending', 'version', 'turns')
if m[1] and m[1] ~= '' then return {'busy', m[1]} end
if m[2] ~= ARGV[2] or m[3] ~= ARGV[3] then return {'changed'} end
local keep = tonumber(ARGV[4])
if keep == 0 then redis.call('DEL', KEYS[2]) else redis.call('LTRIM', KEYS[2], 0, keep - 1) end
local size = 0
for _, t in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do size = size + #t end
local version = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], 'turns', keep, 'bytes', size)
touch(KEYS[1], KEYS[2], ARGV[1])
return {'reserved', version}
"""

# Closes: items appended while a turn runs (they would land between that turn's input and its output) or on
# a history that changed since the request read it.
# Reply: {'reserved'}, {'busy', pending}, {'changed'}, {'gone'}, {'quota'} (past the owner's storage quota).
APPEND = _TOUCH + """
-- KEYS: meta, turns ; ARGV: digest, version, turns, storage quota (this partition's share; 0: none), turn records...
if redis.call('EXISTS', KEYS[1]) == 0 then return {'gone'} end
local m = redis.call('HMGET', KEYS[1], 'pending', 'version', 'turns', 'qs')
if m[1] and m[1] ~= '' then return {'busy', m[1]} end
if m[2] ~= ARGV[2] or m[3] ~= ARGV[3] then return {'changed'} end
local size = 0
for i = 5, #ARGV do size = size + #ARGV[i] end
if m[4] then
  quota_sweep(m[4])
  if not quota_room(m[4], size, tonumber(ARGV[4])) then return {'quota'} end
end
for i = 5, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('HINCRBY', KEYS[1], 'turns', #ARGV - 4)
redis.call('HINCRBY', KEYS[1], 'bytes', size)
touch(KEYS[1], KEYS[2], ARGV[1])
return {'reserved'}
"""

# Sets OpenAI's metadata of a conversation (never creates one).
UPDATE = _TOUCH + """
-- KEYS: meta, turns ; ARGV: digest, metadata
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'metadata', ARGV[2])
touch(KEYS[1], KEYS[2], ARGV[1])
return 1
"""

# Deletes a conversation and its place in its owner's count, in one step. A turn still running goes on and
# folds into nothing (FOLD never creates a conversation).
DELETE = QUOTA_LUA + """
-- KEYS: meta, turns ; ARGV: digest
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local m = redis.call('HMGET', KEYS[1], 'owner', 'qs')
if m[1] then redis.call('ZREM', m[1], ARGV[1]) end
redis.call('DEL', KEYS[1], KEYS[2])
if m[2] then quota_release(m[2], KEYS[1]) end
return 1
"""

# On the stream's side, in its slot: closes a reservation being taken back while its creator, late, creates
# the stream after all. The id is taken only while no stream has it, by the tombstone CREATE refuses (a
# late create then fails, and its caller answers a conflict); a stream that exists was created in time and
# is the conversation's turn. Reply: 1 taken, 0 the stream exists.
TAKE = """
-- KEYS: stream meta, stream tombstone ; ARGV: ttl_s
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[1])
return 1
"""
