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

from broker.redis.quota import QUOTA_LUA

# QUOTA_LUA: the owner's storage quota (broker.redis.quota), charged in the step that stores the data; a stream's
# meta field ``qs`` names the hash of the caller that created it (who is charged for it, whoever appends).
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

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A fresh id above the tail: now, or the tail's millisecond with the next sequence number.
local function mint(tail)
  local now = string.format('%d', now_ms())
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
    redis.call('ZADD', tenant, 'XX', string.format('%d', now_ms() + ms), meta)
    if e[3] then quota_expire(e[3], meta, string.format('%d', now_ms() + ms)) end
  elseif e[2] then
    for _, k in ipairs(keys) do redis.call('PEXPIREAT', k, e[2]) end
  end
end
"""

# Closes: two PUTs of one name racing (one creates, the other sees it and compares configurations), a create
# racing the per-key stream count, and a stream visible before its initial data or fork copy is in place.
CREATE = _HELPERS + """
-- KEYS: meta, data, producers, forks, tenant, storage (the creating caller's: broker.redis.quota)
-- ARGV: 1 name, 2 ct, 3 ctn, 4 ctn to compare ('' = any: a fork inheriting its source's), 5 ttl, 6 exp,
--       7 expms, 8 inherit (1: a fork that asked for no expiry: TTL/Expires-At not compared), 9 closed,
--       10 from, 11 fork offset, 12 fork offset given, 13 sub-offset, 14 gen, 15 probe, 16 max streams,
--       17 size, 18 json, 19 storage quota (this partition's share; 0: none); then (id or '' to mint, bytes)
--       per entry, in order
local m = KEYS[1]
if redis.call('EXISTS', m) == 1 then
  local e = redis.call('HMGET', m, 'soft', 'ctn', 'ttl', 'exp', 'closed', 'from', 'fo', 'fso', 'tail', 'ct')
  local from = e[6] or ''
  if e[1] == '1' then return {'soft', from} end
  local same = (ARGV[4] == '' or ARGV[4] == e[2])
    and (ARGV[8] == '1' or ((e[3] or '') == ARGV[5] and (e[4] or '') == ARGV[6]))
    and (e[5] or '0') == ARGV[9] and from == ARGV[10]
    and (ARGV[12] == '0' or (e[7] or '') == ARGV[11]) and (e[8] or '0') == ARGV[13]
  if same then return {'exists', from, e[9], e[10], e[5] or '0'} end
  return {'conflict', from}
end
if ARGV[15] == '1' then return {'absent'} end
quota_sweep(KEYS[6])  -- first: a full Redis refuses the script here, before the writes below
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. string.format('%d', now))
local max = tonumber(ARGV[16])
if max > 0 and redis.call('ZCARD', KEYS[5]) >= max then return {'limit'} end
if not quota_room(KEYS[6], tonumber(ARGV[17]), tonumber(ARGV[19])) then return {'quota', ''} end
-- Whatever an expired incarnation of this name left behind (its keys expire together, but not atomically).
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
local tail = '0-0'
if ARGV[11] ~= '' then tail = ARGV[11] end
for i = 20, #ARGV, 2 do
  local id = ARGV[i]
  if id == '' then id = mint(tail) end
  redis.call('XADD', KEYS[2], id, 'b', ARGV[i + 1])
  tail = id
end
redis.call('HSET', m, 'name', ARGV[1], 'ct', ARGV[2], 'ctn', ARGV[3], 'json', ARGV[18], 'tail', tail,
  'closed', ARGV[9], 'gen', ARGV[14], 'size', ARGV[17])
local score = 'inf'
if ARGV[5] ~= '' then
  redis.call('HSET', m, 'ttl', ARGV[5])
  score = string.format('%d', now + tonumber(ARGV[5]) * 1000)
elseif ARGV[7] ~= '' then
  redis.call('HSET', m, 'exp', ARGV[6], 'expms', ARGV[7])
  score = ARGV[7]
end
if ARGV[10] ~= '' then redis.call('HSET', m, 'from', ARGV[10], 'fo', ARGV[11], 'fso', ARGV[13]) end
redis.call('ZADD', KEYS[5], score, m)
-- Charged to this caller: a charge left by an earlier incarnation of this name (expired, not swept yet) goes.
redis.call('HSET', m, 'qs', KEYS[6])
quota_release(KEYS[6], m)
quota_charge(KEYS[6], m, tonumber(ARGV[17]))
quota_expire(KEYS[6], m, score)
refresh(m, {m, KEYS[2]}, KEYS[5])
return {'created', tail}
"""

# Closes: two appends racing for the tail (ids strictly increase), a producer's retry racing its first try
# (validation and append are one step: a duplicate is recognised, never stored twice), an append racing the
# close (nothing lands after the final offset), and a zombie producer writing after its successor (epoch
# fencing in the same step as the write).
APPEND = _HELPERS + """
-- KEYS: meta, data, producers, forks, tenant
-- ARGV: 1 channel, 2 body (stored form; '' for close-only), 3 ctn, 4 close, 5 Stream-Seq ('' none),
--       6 producer id ('' none), 7 epoch, 8 seq, 9 body valid (0: invalid JSON), 10 max size (0: none),
--       11 charge (size this append adds), 12 storage quota (this partition's share; 0: none)
local m = KEYS[1]
local e = redis.call('HMGET', m, 'soft', 'closed', 'tail', 'cby', 'ctn', 'lseq', 'size', 'qs')
if not e[3] then return {'notfound'} end
if e[1] == '1' then return {'gone'} end
local keys = {m, KEYS[2], KEYS[3], KEYS[4]}
local body, close, pid = ARGV[2], ARGV[4] == '1', ARGV[6]
local tuple = ''
if pid ~= '' then tuple = pid .. '\\n' .. ARGV[7] .. '\\n' .. ARGV[8] end
if e[2] == '1' then
  -- A producer retrying the request that closed the stream did succeed: same answer again.
  if tuple ~= '' and tuple == e[4] then refresh(m, keys, KEYS[5]); return {'dup_closed', e[3]} end
  if body == '' and close and pid == '' then refresh(m, keys, KEYS[5]); return {'closed_ok', e[3]} end
  return {'closed', e[3]}
end
if body ~= '' and ARGV[3] ~= e[5] then return {'ct_mismatch', e[3]} end
if pid ~= '' then
  local st = redis.call('HGET', KEYS[3], pid)
  local epoch, seq = tonumber(ARGV[7]), tonumber(ARGV[8])
  if not st then
    if seq ~= 0 then return {'gap', '0', ARGV[8]} end
  else
    local sp = string.find(st, ' ', 1, true)
    local se, ss = string.sub(st, 1, sp - 1), string.sub(st, sp + 1)
    if epoch < tonumber(se) then return {'stale', se} end
    if epoch == tonumber(se) then
      if seq <= tonumber(ss) then return {'dup', ss, e[3]} end
      if seq ~= tonumber(ss) + 1 then return {'gap', string.format('%d', tonumber(ss) + 1), ARGV[8]} end
    elseif seq ~= 0 then
      return {'bad_epoch'}
    end
  end
end
if ARGV[5] ~= '' and e[6] and cmp_bytes(ARGV[5], e[6]) <= 0 then return {'seq_conflict', e[6]} end
if ARGV[9] ~= '1' then return {'bad_body'} end
local tail = e[3]
if body ~= '' then
  local size = tonumber(e[7] or '0') + tonumber(ARGV[11])
  if tonumber(ARGV[10]) > 0 and size > tonumber(ARGV[10]) then return {'too_big'} end
  if e[8] then  -- the creator's quota (streams made before quotas have none)
    quota_sweep(e[8])
    if not quota_room(e[8], tonumber(ARGV[11]), tonumber(ARGV[12])) then return {'quota'} end
  end
  tail = mint(tail)
  redis.call('XADD', KEYS[2], tail, 'b', body)
  redis.call('HSET', m, 'tail', tail, 'size', string.format('%d', size))
  if e[8] then quota_charge(e[8], m, tonumber(ARGV[11])) end
end
if ARGV[5] ~= '' then redis.call('HSET', m, 'lseq', ARGV[5]) end
if pid ~= '' then redis.call('HSET', KEYS[3], pid, ARGV[7] .. ' ' .. ARGV[8]) end
local kind = 'a'
if close then
  kind = 'c'
  redis.call('HSET', m, 'closed', '1')
  if tuple ~= '' then redis.call('HSET', m, 'cby', tuple) end
end
refresh(m, keys, KEYS[5])
redis.call('PUBLISH', ARGV[1], tail .. '\\n' .. kind .. '\\n')
return {'ok', tail}
"""

# Closes: a read seeing data without the close that made it final, or the close without all of the data
# (tail, closed flag and entries come from one snapshot), and a TTL expiring between a read and its refresh.
READ = _HELPERS + """
-- KEYS: meta, data, producers, forks, tenant ; ARGV: after ('-1' | 'now' | id), count, max bytes, refresh
local m = KEYS[1]
local e = redis.call('HMGET', m, 'soft', 'tail', 'closed', 'ct', 'json', 'gen', 'ttl')
if not e[2] then return {'notfound'} end
if e[1] == '1' then return {'gone'} end
local after = ARGV[1]
if after == 'now' then after = e[2] elseif after == '-1' then after = '0-0' end
local out = {'ok', e[2], e[3] or '0', e[4], e[5] or '0', e[6], after, '0', e[7] or ''}
if cmp_id(after, e[2]) < 0 then
  local count, max = tonumber(ARGV[2]), tonumber(ARGV[3])
  local entries = redis.call('XRANGE', KEYS[2], '(' .. after, '+', 'COUNT', count)
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
if ARGV[4] == '1' then refresh(m, {m, KEYS[2], KEYS[3], KEYS[4]}, KEYS[5]) end
return out
"""

# Closes: a delete racing a fork of the same stream (the fork's reference is either counted, and the
# stream is only soft-deleted, or the fork finds it gone), and live readers missing the delete.
DELETE = QUOTA_LUA + """
-- KEYS: meta, data, producers, forks, tenant ; ARGV: channel
local m = KEYS[1]
local e = redis.call('HMGET', m, 'soft', 'from', 'tail', 'qs')
if not e[3] then return {'notfound'} end
if e[1] == '1' then return {'gone'} end
redis.call('PUBLISH', ARGV[1], e[3] .. '\\nx\\n')
if redis.call('SCARD', KEYS[4]) > 0 then
  -- Forks still read through this name's history: keep it (data included) until the last one goes.
  redis.call('HSET', m, 'soft', '1')
  redis.call('DEL', KEYS[3])
  return {'soft'}
end
redis.call('DEL', m, KEYS[2], KEYS[3], KEYS[4])
redis.call('ZREM', KEYS[5], m)
if e[4] then quota_release(e[4], m) end
return {'deleted', e[2] or ''}
"""

# Closes: the last fork going away while its source is being deleted (the source is collected exactly once:
# whichever of the two steps comes second sees no reference and a soft-deleted stream).
UNREF = QUOTA_LUA + """
-- KEYS: meta, data, producers, forks, tenant ; ARGV: fork name
redis.call('SREM', KEYS[4], ARGV[1])
local e = redis.call('HMGET', KEYS[1], 'soft', 'from', 'qs')
if e[1] == '1' and redis.call('SCARD', KEYS[4]) == 0 then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
  redis.call('ZREM', KEYS[5], KEYS[1])
  if e[3] then quota_release(e[3], KEYS[1]) end
  return {'collected', e[2] or ''}
end
return {'kept'}
"""

# Closes: a fork taken from a stream being deleted (the reference is added in the same step as the checks, so
# the delete sees it and only soft-deletes), and a rejected fork pinning its source (every check comes first).
FORK_REF = _HELPERS + """
-- KEYS: meta, data, forks ; ARGV: fork name, ctn ('' = inherit), fork offset ('' = the tail), sub-offset
local e = redis.call('HMGET', KEYS[1], 'soft', 'tail', 'ct', 'ctn', 'json', 'ttl', 'exp', 'expms', 'gen')
if not e[2] then return {'notfound'} end
if e[1] == '1' then return {'soft'} end
if ARGV[2] ~= '' and ARGV[2] ~= e[4] then return {'ct'} end
local fo = ARGV[3]
if fo == '' then fo = e[2] end
if cmp_id(fo, e[2]) > 0 then return {'offset'} end
local nb = ''
if tonumber(ARGV[4]) > 0 then
  local nx = redis.call('XRANGE', KEYS[2], '(' .. fo, '+', 'COUNT', 1)
  if #nx == 0 then return {'sub'} end
  nb = nx[1][2][2]
end
redis.call('SADD', KEYS[3], ARGV[1])
local pttl = redis.call('PTTL', KEYS[1])
if pttl > 0 then redis.call('PEXPIRE', KEYS[3], pttl) end
return {'ok', fo, e[3], e[4], e[5] or '0', e[6] or '', e[7] or '', e[8] or '', e[9], nb}
"""
