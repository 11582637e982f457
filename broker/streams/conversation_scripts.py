"""The Lua scripts of conversations (broker.streams.conversations), each with the race it closes.

Meta hash fields (``ConversationKeys.meta``): ``created_at`` (Unix s, the server's clock), ``ttl_s`` (the sliding
expiry), ``version`` (bumped when history is rewritten: a branch), ``turns`` (how many finished turns the list holds),
``bytes`` (their records' size), ``pending`` (the stream id of the turn that runs, or is being created; '' =
none), ``pending_at`` (when it was reserved, Unix ms, the server's clock), ``owner`` (the key of the owner's
set, ``ConversationKeys.owner``), ``metadata`` (JSON: OpenAI's 16 key-value pairs), ``waiting`` (the stream ids
of the turns that wait behind the pending one, in order, comma-separated: broker.request.on_busy's ``enqueue`` and
``interrupt``; never any without a pending turn), ``cut`` (the stream id of a waiting turn that interrupts: every
turn before it is cancelled as it comes up; '' = none).

Every script runs in the conversation's slot (its keys share a hash tag, the owner's set included: the owner
key a script reads from ``owner`` is in the same partition). None touches a turn's stream, which lives in
another slot: TAKE is the one script on the stream's side, and it touches only that stream's keys.

Every script that finds the conversation refreshes its sliding expiry (``touch``): the meta, the turns and
the conversation's score in its owner's set (which itself lives as long as its longest-lived member).
"""

from __future__ import annotations

from broker.redis.lua import SERVER_MS, Lua
from broker.redis.quota import QUOTA_LUA

#: The KEYS and the first ARGV of most scripts: the conversation's keys and digest (its member in its owner's set).
CONVERSATION_KEYS = ("meta", "turns")

# Shared Lua: the sliding expiry and the owner's count, refreshed on every use; and the conversation's charge
# against its owner's storage quota (broker.redis.quota: meta ``qs``), kept equal to its ``bytes`` and expiring
# with it.
# (QUOTA_LUA brings server_ms: broker.redis.lua.SERVER_MS.)
_TOUCH = QUOTA_LUA + """
local function touch(meta, turns, digest)
  local m = redis.call('HMGET', meta, 'ttl_s', 'owner', 'qs', 'bytes')
  local ttl = tonumber(m[1] or '0')
  if m[3] then
    local delta = tonumber(m[4] or '0') - tonumber(redis.call('HGET', m[3], meta) or '0')
    if delta ~= 0 then quota_charge(m[3], meta, delta) end
    if ttl > 0 then quota_expire(m[3], meta, string.format('%d', server_ms() + ttl * 1000)) end
  end
  if ttl <= 0 then return end
  redis.call('EXPIRE', meta, ttl)
  if redis.call('EXISTS', turns) == 1 then redis.call('EXPIRE', turns, ttl) end
  if m[2] then
    redis.call('ZADD', m[2], server_ms() + ttl * 1000, digest)
    if redis.call('PTTL', m[2]) < ttl * 1000 then redis.call('PEXPIRE', m[2], ttl * 1000) end
  end
end
"""

# Shared Lua: the pending turn is done with (folded, or no turn after all): the first waiting turn becomes the
# pending one (reserved now: its stream exists, held, or is a round trip away), and an interrupting turn that comes
# up is no longer one. Returns the new pending turn's id ('' for none).
_NEXT = """
local function next_turn(meta)
  local w = redis.call('HGET', meta, 'waiting') or ''
  if w == '' then
    redis.call('HSET', meta, 'pending', '', 'pending_at', 0)
    return ''
  end
  local head, rest = w, ''
  local comma = string.find(w, ',', 1, true)
  if comma then head, rest = string.sub(w, 1, comma - 1), string.sub(w, comma + 1) end
  redis.call('HSET', meta, 'pending', head, 'pending_at', server_ms(), 'waiting', rest)
  if redis.call('HGET', meta, 'cut') == head then redis.call('HSET', meta, 'cut', '') end
  return head
end

local function waiting_ids(meta)
  local out = {}
  for sid in string.gmatch(redis.call('HGET', meta, 'waiting') or '', '[^,]+') do out[#out + 1] = sid end
  return out
end
"""

# Shared Lua: a new conversation, counted against its owner's limit in the same step (a count read in one
# round trip and incremented in another would let a flood of creates through past it). Expired members are
# dropped from the owner's set first: their keys expired by themselves.
_OPEN = """
local function open(meta, turns, owner, digest, ttl, max_count, metadata, storage)
  quota_sweep(storage)  -- first: a full Redis refuses the script here, before ZREMRANGEBYSCORE lets writes by
  local now = server_ms()
  redis.call('ZREMRANGEBYSCORE', owner, '-inf', now)
  if max_count > 0 and redis.call('ZCARD', owner) >= max_count then return false end
  redis.call('HSET', meta, 'created_at', string.format('%.6f', now / 1000), 'ttl_s', ttl, 'version', 0, 'turns', 0,
    'bytes', 0, 'pending', '', 'pending_at', 0, 'owner', owner, 'metadata', metadata, 'qs', storage)
  return true
end
"""

# Reads a conversation: its meta and (A.with_turns = 1) every finished turn, in one step, so the turns are those
# the meta counts. Reading is using: it restarts the sliding expiry.
# Reply: {} (no such conversation) or {created_at, version, turns, bytes, pending, pending age ms, metadata,
# waiting, cut, turn records...}.
READ = Lua(_TOUCH + """
if redis.call('EXISTS', K.meta) == 0 then return {} end
touch(K.meta, K.turns, A.digest)
local m = redis.call('HMGET', K.meta, 'created_at', 'version', 'turns', 'bytes', 'pending', 'pending_at', 'metadata',
  'waiting', 'cut')
local age = 0
if m[5] and m[5] ~= '' then age = server_ms() - tonumber(m[6] or '0') end
local out = {m[1] or '0', m[2] or '0', m[3] or '0', m[4] or '0', m[5] or '', tostring(age), m[7] or '{}', m[8] or '',
  m[9] or ''}
if A.with_turns == '1' then
  for _, t in ipairs(redis.call('LRANGE', K.turns, 0, -1)) do out[#out + 1] = t end
end
return out
""", key_names=CONVERSATION_KEYS, arg_names=("digest", "with_turns"))

# Closes: two creates of one conversation id at once (OpenAI's POST /v1/conversations makes ids, but rsb's
# native creates name their own). Initial turns (items) are stored with it: their records past the named ARGV.
# A.storage_share: this partition's share of the owner's storage quota (0: none).
# Reply: {'reserved'} (made), {'exists'}, {'full'} (the owner holds as many as it may), {'quota'} (the items do
# not fit the owner's storage quota).
CREATE = Lua(_TOUCH + _OPEN + """
if redis.call('EXISTS', K.meta) == 1 then return {'exists'} end
local size = 0
for i = A_NAMES + 1, #ARGV do size = size + #ARGV[i] end
quota_sweep(K.storage)
if not quota_room(K.storage, size, tonumber(A.storage_share)) then return {'quota'} end
if not open(K.meta, K.turns, K.owner, A.digest, tonumber(A.ttl_s), tonumber(A.max_conversations),
    A.metadata, K.storage) then
  return {'full'}
end
for i = A_NAMES + 1, #ARGV do redis.call('RPUSH', K.turns, ARGV[i]) end
redis.call('HSET', K.meta, 'turns', #ARGV - A_NAMES, 'bytes', size)
touch(K.meta, K.turns, A.digest)
return {'reserved'}
""", key_names=(*CONVERSATION_KEYS, "owner", "storage"),
    arg_names=("digest", "ttl_s", "max_conversations", "metadata", "storage_share"))

# Closes: two devices starting the next turn at once (one turn, and a conflict for the other), and a turn
# started on a history that changed since its request read it (a turn folded in, a branch): its prompt would
# be built on turns that are no longer the conversation's. The turn is reserved here, in the conversation's
# slot, by the stream id it will have; the stream is created next, in its own slot. A reservation whose stream
# never came (the creating process died in between) is taken back by TAKE, then RELEASE.
# A.version, A.turns: what the request read (0, 0 and a missing conversation with A.create = 1: create it, as
# the native create does for a conversation id it has not seen).
# Reply (broker.streams.conversations.Begin): {'reserved'}, {'already'} (reserved for this stream: a retry),
# {'busy', pending} (another turn is pending), {'changed'} (the history changed), {'gone'} (no such
# conversation), {'full'} (the owner holds as many as it may).
BEGIN = Lua(_TOUCH + _OPEN + """
if redis.call('EXISTS', K.meta) == 0 then
  if A.create ~= '1' or A.version ~= '0' or A.turns ~= '0' then return {'gone'} end
  if not open(K.meta, K.turns, K.owner, A.digest, tonumber(A.ttl_s), tonumber(A.max_conversations),
      '{}', K.storage) then
    return {'full'}
  end
end
local m = redis.call('HMGET', K.meta, 'pending', 'version', 'turns')
if m[1] == A.sid then
  touch(K.meta, K.turns, A.digest)
  return {'already'}
end
if m[1] and m[1] ~= '' then return {'busy', m[1]} end
if m[2] ~= A.version or m[3] ~= A.turns then return {'changed'} end
redis.call('HSET', K.meta, 'pending', A.sid, 'pending_at', server_ms())
touch(K.meta, K.turns, A.digest)
return {'reserved'}
""", key_names=(*CONVERSATION_KEYS, "owner", "storage"),
    arg_names=("digest", "version", "turns", "sid", "ttl_s", "max_conversations", "create"))

# Closes: a turn's output landing twice (the worker that finished it, a pod that read the conversation and
# found it ended, a retry whose reply was lost: all fold the same record, built from the stream's events) or
# landing in a conversation that moved on (deleted, or a reservation taken back). Only the pending turn
# folds, and folding clears it in the same step: exactly once. The first waiting turn becomes the pending one in
# that same step, so it starts on a history that holds every turn before it. Never creates a conversation.
FOLD = Lua(_TOUCH + _NEXT + """
if redis.call('EXISTS', K.meta) == 0 then return 0 end
if redis.call('HGET', K.meta, 'pending') ~= A.sid then return 0 end
redis.call('RPUSH', K.turns, A.record)
redis.call('HINCRBY', K.meta, 'turns', 1)
redis.call('HINCRBY', K.meta, 'bytes', #A.record)
next_turn(K.meta)
touch(K.meta, K.turns, A.digest)
return 1
""", key_names=CONVERSATION_KEYS, arg_names=("digest", "sid", "record"))

# Takes a turn that is no turn after all out of the conversation (a create that was refused: the queue was full,
# the id was taken; a reservation taken back, TAKE), only while it is still this stream's: the pending one (the
# first waiting turn comes up) or a waiting one (out of line). A newer reservation is never touched.
RELEASE = Lua(SERVER_MS + _NEXT + """
if redis.call('HGET', K.meta, 'pending') == A.sid then
  next_turn(K.meta)
  return 1
end
local kept, found = {}, false
for _, sid in ipairs(waiting_ids(K.meta)) do
  if sid == A.sid then found = true else kept[#kept + 1] = sid end
end
if not found then return 0 end
redis.call('HSET', K.meta, 'waiting', table.concat(kept, ','))
if redis.call('HGET', K.meta, 'cut') == A.sid then redis.call('HSET', K.meta, 'cut', '') end
return 1
""", key_names=("meta",), arg_names=("sid",))

# Closes: a user who sends again while a turn runs (broker.request.on_busy), from two devices at once too: the new turn
# waits in line behind the pending one, in the order the sends reached Redis, and is started (by FOLD, at the end
# of the turn before it) on a history that holds every turn before it. ``interrupt`` also marks it ``cut``: the
# turns before it are cancelled (the pending one for real, by its caller and by whoever settles the conversation
# next; the waiting ones as they come up), the last interrupt winning. A.version: what the request read (a branch
# since makes it plan again); A.max_waiting: how many turns may wait. A missing conversation (A.create = 1) is made,
# and then nothing runs in it.
# Reply: {'queued', pending, turns waiting before it}, {'already'} (this stream is the pending or a waiting turn: a
# retry), {'idle'} (no turn runs: start it the ordinary way, BEGIN), {'changed'}, {'gone'}, {'full'} (the owner
# holds as many conversations as it may), {'busy', pending} (as many turns wait as may).
QUEUE = Lua(_TOUCH + _OPEN + _NEXT + """
if redis.call('EXISTS', K.meta) == 0 then
  if A.create ~= '1' or A.version ~= '0' then return {'gone'} end
  if not open(K.meta, K.turns, K.owner, A.digest, tonumber(A.ttl_s), tonumber(A.max_conversations),
      '{}', K.storage) then
    return {'full'}
  end
end
local m = redis.call('HMGET', K.meta, 'pending', 'version')
local waiting = waiting_ids(K.meta)
if m[1] == A.sid then return {'already'} end
for _, sid in ipairs(waiting) do
  if sid == A.sid then return {'already'} end
end
if not m[1] or m[1] == '' then return {'idle'} end
if m[2] ~= A.version then return {'changed'} end
if #waiting >= tonumber(A.max_waiting) then return {'busy', m[1]} end
waiting[#waiting + 1] = A.sid
redis.call('HSET', K.meta, 'waiting', table.concat(waiting, ','))
if A.mode == 'interrupt' then redis.call('HSET', K.meta, 'cut', A.sid) end
touch(K.meta, K.turns, A.digest)
return {'queued', m[1], tostring(#waiting - 1)}
""", key_names=(*CONVERSATION_KEYS, "owner", "storage"),
    arg_names=("digest", "version", "sid", "mode", "max_waiting", "ttl_s", "max_conversations", "create"))

# Closes: a turn started (reserved) while the history is rewritten under it, and two rewrites at once. Keeps
# the first ``keep`` turns (the AI SDK's regenerate and edit continue from an earlier turn) and bumps the
# version, so that requests built on the old history fail BEGIN's check.
# Reply: {'reserved', new version}, {'busy', pending}, {'changed'}, {'gone'}.
BRANCH = Lua(_TOUCH + """
if redis.call('EXISTS', K.meta) == 0 then return {'gone'} end
local m = redis.call('HMGET', K.meta, 'pending', 'version', 'turns')
if m[1] and m[1] ~= '' then return {'busy', m[1]} end
if m[2] ~= A.version or m[3] ~= A.turns then return {'changed'} end
local keep = tonumber(A.keep)
if keep == 0 then redis.call('DEL', K.turns) else redis.call('LTRIM', K.turns, 0, keep - 1) end
local size = 0
for _, t in ipairs(redis.call('LRANGE', K.turns, 0, -1)) do size = size + #t end
local version = redis.call('HINCRBY', K.meta, 'version', 1)
redis.call('HSET', K.meta, 'turns', keep, 'bytes', size)
touch(K.meta, K.turns, A.digest)
return {'reserved', version}
""", key_names=CONVERSATION_KEYS, arg_names=("digest", "version", "turns", "keep"))

# Closes: items appended while a turn runs (they would land between that turn's input and its output) or on
# a history that changed since the request read it. The turn records come past the named ARGV.
# Reply: {'reserved'}, {'busy', pending}, {'changed'}, {'gone'}, {'quota'} (past the owner's storage quota).
APPEND = Lua(_TOUCH + """
if redis.call('EXISTS', K.meta) == 0 then return {'gone'} end
local m = redis.call('HMGET', K.meta, 'pending', 'version', 'turns', 'qs')
if m[1] and m[1] ~= '' then return {'busy', m[1]} end
if m[2] ~= A.version or m[3] ~= A.turns then return {'changed'} end
local size = 0
for i = A_NAMES + 1, #ARGV do size = size + #ARGV[i] end
if m[4] then
  quota_sweep(m[4])
  if not quota_room(m[4], size, tonumber(A.storage_share)) then return {'quota'} end
end
for i = A_NAMES + 1, #ARGV do redis.call('RPUSH', K.turns, ARGV[i]) end
redis.call('HINCRBY', K.meta, 'turns', #ARGV - A_NAMES)
redis.call('HINCRBY', K.meta, 'bytes', size)
touch(K.meta, K.turns, A.digest)
return {'reserved'}
""", key_names=CONVERSATION_KEYS, arg_names=("digest", "version", "turns", "storage_share"))

# Sets OpenAI's metadata of a conversation (never creates one).
UPDATE = Lua(_TOUCH + """
if redis.call('EXISTS', K.meta) == 0 then return 0 end
redis.call('HSET', K.meta, 'metadata', A.metadata)
touch(K.meta, K.turns, A.digest)
return 1
""", key_names=CONVERSATION_KEYS, arg_names=("digest", "metadata"))

# Deletes a conversation and its place in its owner's count, in one step. A turn still running goes on and
# folds into nothing (FOLD never creates a conversation); the turns that waited will never start: their ids come
# back, with the pending one's (it may be a waiting turn just come up, not started yet), for the caller to cancel
# their streams (in their own slots).
# Reply: {} (no such conversation) or {'deleted', pending ('' for none), waiting stream ids...}.
DELETE = Lua(QUOTA_LUA + _NEXT + """
if redis.call('EXISTS', K.meta) == 0 then return {} end
local m = redis.call('HMGET', K.meta, 'owner', 'qs', 'pending')
local out = {'deleted', m[3] or ''}
for _, sid in ipairs(waiting_ids(K.meta)) do out[#out + 1] = sid end
if m[1] then redis.call('ZREM', m[1], A.digest) end
redis.call('DEL', K.meta, K.turns)
if m[2] then quota_release(m[2], K.meta) end
return out
""", key_names=CONVERSATION_KEYS, arg_names=("digest",))

# On the stream's side, in its slot: closes a reservation being taken back while its creator, late, creates
# the stream after all. The id is taken only while no stream has it, by the tombstone CREATE refuses (a
# late create then fails, and its caller answers a conflict); a stream that exists was created in time and
# is the conversation's turn. Reply: 1 taken, 0 the stream exists.
TAKE = Lua("""
if redis.call('EXISTS', K.meta) == 1 then return 0 end
redis.call('SET', K.tombstone, '1', 'EX', A.ttl_s)
return 1
""", key_names=("meta", "tombstone"), arg_names=("ttl_s",))
