"""The Lua scripts behind Durable Streams (broker.durable.store): each atomic step of the protocol is one script in
one hash slot (every key of a stream, and its tenant's set, share the partition's tag: broker.streams.keys).
broker.streams.scripts holds the scripts of rsb's own generations; these are the same kind of thing for streams that
clients name and write.

Meta hash fields (``DurableKeys.meta``): ``ct`` (content type as first given), ``ctn`` (normalized: media type,
lowercased), ``json`` (1: JSON mode), ``tail`` (the Redis id of the end of the stream: the last entry's, or a
fork's fork offset before it has entries of its own; ``0-0`` when empty), ``closed``, ``cby`` (the producer tuple
``id\\nepoch\\nseq`` that closed it), ``lseq`` (last ``Stream-Seq``), ``soft`` (1: deleted while forks still
reference it), ``ttl`` / ``exp`` + ``expms`` (sliding TTL in seconds / ``Stream-Expires-At`` as given and in ms),
``from``, ``fo``, ``fso`` (fork source name, resolved fork offset, sub-offset as given), ``gen`` (random per
incarnation: ETags of a re-created stream never match the old one's), ``size`` (bytes charged, for the size cap).

Entries of the data stream have one field ``b``: the appended bytes; in JSON mode the POST's items, each
compact JSON (never a raw newline), joined by ``\\n``. Entry ids are minted here, not by ``XADD *``: an id is
derived from the stream's ``tail``, so it is above every offset a fork inherited even when the fork's shard
clock is behind its source's.

Every append, close and delete PUBLISHes ``<id>\\n<kind>\\n`` (kind ``a`` append, ``c`` close, ``x`` deleted) on
the stream's channel: live readers wake up and read the stream itself (it stays the source of truth).
``broker.redis.connection.register_script`` turns the publishes into SPUBLISH on Redis Cluster, as for every
other script.

Strings are never compared with Lua's ``<``: Lua 5.1 compares strings with strcoll, and redis-server sets its
collation from the locale at start, so ``"B" <= "a"`` depends on the server's environment. ``cmp_bytes`` compares
byte by byte (``Stream-Seq`` is specified as byte-wise lexicographic); ids compare as padded digits.
"""

from __future__ import annotations

from broker.redis.lua import Lua
from broker.redis.quota import QUOTA_LUA

#: The KEYS of most scripts: a stream's keys (broker.durable.keys.DurableKeys.script_keys).
STREAM_KEYS = ("meta", "data", "producers", "forks", "tenant")

# QUOTA_LUA: the owner's storage quota (broker.redis.quota), charged in the step that stores the data; a stream's
# meta field ``qs`` names the hash of the caller that created it (who is charged for it, whoever appends).
# (QUOTA_LUA brings server_ms: broker.redis.lua.SERVER_MS.)
_HELPERS = QUOTA_LUA + """
local function cmp_bytes(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      if x < y then return -1 end
      return 1
    end
  end
  if #a == #b then return 0 elseif #a < #b then return -1 end
  return 1
end

local function pad(s) return string.rep('0', 20 - #s) .. s end

local function split_id(id)
  local i = string.find(id, '-', 1, true)
  return string.sub(id, 1, i - 1), string.sub(id, i + 1)
end

-- Redis ids ('ms-seq', unsigned 64-bit parts) in numeric order, without going through Lua's doubles.
local function cmp_id(a, b)
  local ams, aseq = split_id(a)
  local bms, bseq = split_id(b)
  local c = cmp_bytes(pad(ams), pad(bms))
  if c ~= 0 then return c end
  return cmp_bytes(pad(aseq), pad(bseq))
end

-- A fresh id above the tail: now, or the tail's millisecond with the next sequence number.
local function mint(tail)
  local now = string.format('%d', server_ms())
  local ms, seq = split_id(tail)
  if cmp_bytes(pad(now), pad(ms)) > 0 then return now .. '-0' end
  return ms .. '-' .. string.format('%d', tonumber(seq) + 1)
end

-- Every read and write restarts a sliding TTL (Stream-TTL) on every key of the stream and on its entry in
-- the tenant's set; Stream-Expires-At is a fixed deadline, also applied to keys created since (data,
-- producers, forks). HEAD does not come here.
local function refresh(meta, keys, tenant)
  local e = redis.call('HMGET', meta, 'ttl', 'expms', 'qs')
  if e[1] then
    local ms = tonumber(e[1]) * 1000
    for _, k in ipairs(keys) do redis.call('PEXPIRE', k, string.format('%d', ms)) end
    redis.call('ZADD', tenant, 'XX', string.format('%d', server_ms() + ms), meta)
    if e[3] then quota_expire(e[3], meta, string.format('%d', server_ms() + ms)) end
  elseif e[2] then
    for _, k in ipairs(keys) do redis.call('PEXPIREAT', k, e[2]) end
  end
end
"""

# Closes: two PUTs of one name racing (one creates, the other sees it and compares configurations), a create
# racing the per-key stream count, and a stream visible before its initial data or fork copy is in place.
# A.ctn_match: '' = any (a fork inheriting its source's); A.inherit: 1 for a fork that asked for no expiry
# (TTL/Expires-At not compared); A.storage_share: this partition's share of the quota (0: none); K.storage: the
# creating caller's (broker.redis.quota). Past the named ARGV: (id or '' to mint, bytes) per entry, in order.
CREATE = Lua(_HELPERS + """
local m = K.meta
if redis.call('EXISTS', m) == 1 then
  local e = redis.call('HMGET', m, 'soft', 'ctn', 'ttl', 'exp', 'closed', 'from', 'fo', 'fso', 'tail', 'ct')
  local from = e[6] or ''
  if e[1] == '1' then return {'soft', from} end
  local same = (A.ctn_match == '' or A.ctn_match == e[2])
    and (A.inherit == '1' or ((e[3] or '') == A.ttl and (e[4] or '') == A.exp))
    and (e[5] or '0') == A.closed and from == A.from
    and (A.offset_given == '0' or (e[7] or '') == A.fork_offset) and (e[8] or '0') == A.sub_offset
  if same then return {'exists', from, e[9], e[10], e[5] or '0'} end
  return {'conflict', from}
end
if A.probe == '1' then return {'absent'} end
quota_sweep(K.storage)  -- first: a full Redis refuses the script here, before the writes below
local now = server_ms()
redis.call('ZREMRANGEBYSCORE', K.tenant, '-inf', '(' .. string.format('%d', now))
local max = tonumber(A.max_streams)
if max > 0 and redis.call('ZCARD', K.tenant) >= max then return {'limit'} end
if not quota_room(K.storage, tonumber(A.size), tonumber(A.storage_share)) then return {'quota', ''} end
-- Whatever an expired incarnation of this name left behind (its keys expire together, but not atomically).
redis.call('DEL', K.data, K.producers, K.forks)
local tail = '0-0'
if A.fork_offset ~= '' then tail = A.fork_offset end
for i = A_NAMES + 1, #ARGV, 2 do
  local id = ARGV[i]
  if id == '' then id = mint(tail) end
  redis.call('XADD', K.data, id, 'b', ARGV[i + 1])
  tail = id
end
redis.call('HSET', m, 'name', A.name, 'ct', A.ct, 'ctn', A.ctn, 'json', A.json, 'tail', tail,
  'closed', A.closed, 'gen', A.gen, 'size', A.size)
local score = 'inf'
if A.ttl ~= '' then
  redis.call('HSET', m, 'ttl', A.ttl)
  score = string.format('%d', now + tonumber(A.ttl) * 1000)
elseif A.expms ~= '' then
  redis.call('HSET', m, 'exp', A.exp, 'expms', A.expms)
  score = A.expms
end
if A.from ~= '' then redis.call('HSET', m, 'from', A.from, 'fo', A.fork_offset, 'fso', A.sub_offset) end
redis.call('ZADD', K.tenant, score, m)
-- Charged to this caller: a charge left by an earlier incarnation of this name (expired, not swept yet) goes.
redis.call('HSET', m, 'qs', K.storage)
quota_release(K.storage, m)
quota_charge(K.storage, m, tonumber(A.size))
quota_expire(K.storage, m, score)
refresh(m, {m, K.data}, K.tenant)
return {'created', tail}
""", key_names=(*STREAM_KEYS, "storage"),
    arg_names=("name", "ct", "ctn", "ctn_match", "ttl", "exp", "expms", "inherit", "closed", "from", "fork_offset",
               "offset_given", "sub_offset", "gen", "probe", "max_streams", "size", "json", "storage_share"))

# Closes: two appends racing for the tail (ids strictly increase), a producer's retry racing its first try
# (validation and append are one step: a duplicate is recognised, never stored twice), an append racing the
# close (nothing lands after the final offset), and a zombie producer writing after its successor (epoch
# fencing in the same step as the write). A.body: the stored form ('' for close-only); A.stream_seq, A.producer:
# '' for none; A.valid: 0 for invalid JSON; A.max_size: 0 for none; A.charge: the size this append adds;
# A.storage_share: this partition's share of the quota (0: none).
APPEND = Lua(_HELPERS + """
local m = K.meta
local e = redis.call('HMGET', m, 'soft', 'closed', 'tail', 'cby', 'ctn', 'lseq', 'size', 'qs')
if not e[3] then return {'notfound'} end
if e[1] == '1' then return {'gone'} end
local keys = {m, K.data, K.producers, K.forks}
local body, close, pid = A.body, A.close == '1', A.producer
local tuple = ''
if pid ~= '' then tuple = pid .. '\\n' .. A.epoch .. '\\n' .. A.seq end
if e[2] == '1' then
  -- A producer retrying the request that closed the stream did succeed: same answer again.
  if tuple ~= '' and tuple == e[4] then refresh(m, keys, K.tenant); return {'dup_closed', e[3]} end
  if body == '' and close and pid == '' then refresh(m, keys, K.tenant); return {'closed_ok', e[3]} end
  return {'closed', e[3]}
end
if body ~= '' and A.ctn ~= e[5] then return {'ct_mismatch', e[3]} end
if pid ~= '' then
  local st = redis.call('HGET', K.producers, pid)
  local epoch, seq = tonumber(A.epoch), tonumber(A.seq)
  if not st then
    if seq ~= 0 then return {'gap', '0', A.seq} end
  else
    local sp = string.find(st, ' ', 1, true)
    local se, ss = string.sub(st, 1, sp - 1), string.sub(st, sp + 1)
    if epoch < tonumber(se) then return {'stale', se} end
    if epoch == tonumber(se) then
      if seq <= tonumber(ss) then return {'dup', ss, e[3]} end
      if seq ~= tonumber(ss) + 1 then return {'gap', string.format('%d', tonumber(ss) + 1), A.seq} end
    elseif seq ~= 0 then
      return {'bad_epoch'}
    end
  end
end
if A.stream_seq ~= '' and e[6] and cmp_bytes(A.stream_seq, e[6]) <= 0 then return {'seq_conflict', e[6]} end
if A.valid ~= '1' then return {'bad_body'} end
local tail = e[3]
if body ~= '' then
  local size = tonumber(e[7] or '0') + tonumber(A.charge)
  if tonumber(A.max_size) > 0 and size > tonumber(A.max_size) then return {'too_big'} end
  if e[8] then  -- the creator's quota (streams made before quotas have none)
    quota_sweep(e[8])
    if not quota_room(e[8], tonumber(A.charge), tonumber(A.storage_share)) then return {'quota'} end
  end
  tail = mint(tail)
  redis.call('XADD', K.data, tail, 'b', body)
  redis.call('HSET', m, 'tail', tail, 'size', string.format('%d', size))
  if e[8] then quota_charge(e[8], m, tonumber(A.charge)) end
end
if A.stream_seq ~= '' then redis.call('HSET', m, 'lseq', A.stream_seq) end
if pid ~= '' then redis.call('HSET', K.producers, pid, A.epoch .. ' ' .. A.seq) end
local kind = 'a'
if close then
  kind = 'c'
  redis.call('HSET', m, 'closed', '1')
  if tuple ~= '' then redis.call('HSET', m, 'cby', tuple) end
end
refresh(m, keys, K.tenant)
redis.call('PUBLISH', A.channel, tail .. '\\n' .. kind .. '\\n')
return {'ok', tail}
""", key_names=STREAM_KEYS,
    arg_names=("channel", "body", "ctn", "close", "stream_seq", "producer", "epoch", "seq", "valid", "max_size",
               "charge", "storage_share"))

# Closes: a read seeing data without the close that made it final, or the close without all of the data
# (tail, closed flag and entries come from one snapshot), and a TTL expiring between a read and its refresh.
# A.after: '-1' | 'now' | an id; A.refresh: 1 to restart a sliding TTL.
READ = Lua(_HELPERS + """
local m = K.meta
local e = redis.call('HMGET', m, 'soft', 'tail', 'closed', 'ct', 'json', 'gen', 'ttl')
if not e[2] then return {'notfound'} end
if e[1] == '1' then return {'gone'} end
local after = A.after
if after == 'now' then after = e[2] elseif after == '-1' then after = '0-0' end
local out = {'ok', e[2], e[3] or '0', e[4], e[5] or '0', e[6], after, '0', e[7] or ''}
if cmp_id(after, e[2]) < 0 then
  local count, max = tonumber(A.count), tonumber(A.max_bytes)
  local entries = redis.call('XRANGE', K.data, '(' .. after, '+', 'COUNT', count)
  local total, taken = 0, 0
  for _, en in ipairs(entries) do
    local b = en[2][2]
    if taken > 0 and total + #b > max then out[8] = '1'; break end
    total = total + #b
    taken = taken + 1
    out[#out + 1] = en[1]
    out[#out + 1] = b
  end
  if taken == count and cmp_id(out[#out - 1], e[2]) < 0 then out[8] = '1' end
end
if A.refresh == '1' then refresh(m, {m, K.data, K.producers, K.forks}, K.tenant) end
return out
""", key_names=STREAM_KEYS, arg_names=("after", "count", "max_bytes", "refresh"))

# Closes: a delete racing a fork of the same stream (the fork's reference is either counted, and the
# stream is only soft-deleted, or the fork finds it gone), and live readers missing the delete.
DELETE = Lua(QUOTA_LUA + """
local m = K.meta
local e = redis.call('HMGET', m, 'soft', 'from', 'tail', 'qs')
if not e[3] then return {'notfound'} end
if e[1] == '1' then return {'gone'} end
redis.call('PUBLISH', A.channel, e[3] .. '\\nx\\n')
if redis.call('SCARD', K.forks) > 0 then
  -- Forks still read through this name's history: keep it (data included) until the last one goes.
  redis.call('HSET', m, 'soft', '1')
  redis.call('DEL', K.producers)
  return {'soft'}
end
redis.call('DEL', m, K.data, K.producers, K.forks)
redis.call('ZREM', K.tenant, m)
if e[4] then quota_release(e[4], m) end
return {'deleted', e[2] or ''}
""", key_names=STREAM_KEYS, arg_names=("channel",))

# Closes: the last fork going away while its source is being deleted (the source is collected exactly once:
# whichever of the two steps comes second sees no reference and a soft-deleted stream).
UNREF = Lua(QUOTA_LUA + """
redis.call('SREM', K.forks, A.fork)
local e = redis.call('HMGET', K.meta, 'soft', 'from', 'qs')
if e[1] == '1' and redis.call('SCARD', K.forks) == 0 then
  redis.call('DEL', K.meta, K.data, K.producers, K.forks)
  redis.call('ZREM', K.tenant, K.meta)
  if e[3] then quota_release(e[3], K.meta) end
  return {'collected', e[2] or ''}
end
return {'kept'}
""", key_names=STREAM_KEYS, arg_names=("fork",))

# Closes: a fork taken from a stream being deleted (the reference is added in the same step as the checks, so
# the delete sees it and only soft-deletes), and a rejected fork pinning its source (every check comes first).
# A.ctn: '' = inherit; A.fork_offset: '' = the tail.
FORK_REF = Lua(_HELPERS + """
local e = redis.call('HMGET', K.meta, 'soft', 'tail', 'ct', 'ctn', 'json', 'ttl', 'exp', 'expms', 'gen')
if not e[2] then return {'notfound'} end
if e[1] == '1' then return {'soft'} end
if A.ctn ~= '' and A.ctn ~= e[4] then return {'ct'} end
local fo = A.fork_offset
if fo == '' then fo = e[2] end
if cmp_id(fo, e[2]) > 0 then return {'offset'} end
local nb = ''
if tonumber(A.sub_offset) > 0 then
  local nx = redis.call('XRANGE', K.data, '(' .. fo, '+', 'COUNT', 1)
  if #nx == 0 then return {'sub'} end
  nb = nx[1][2][2]
end
redis.call('SADD', K.forks, A.fork)
local pttl = redis.call('PTTL', K.meta)
if pttl > 0 then redis.call('PEXPIRE', K.forks, pttl) end
return {'ok', fo, e[3], e[4], e[5] or '0', e[6] or '', e[7] or '', e[8] or '', e[9], nb}
""", key_names=("meta", "data", "forks"), arg_names=("fork", "ctn", "fork_offset", "sub_offset"))
