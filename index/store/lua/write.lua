-- Upsert records of one id shard, atomically: retire each id's old version, allocate
-- a fresh iid, write the record's fields and point the id at it.
-- KEYS: ids, seq, live, dead, ndead (all of the shard, one hash tag)
-- ARGV: the five of shard.lua, then 5 per record:
--       name, vector, sketch, nrff ('' = none), meta ('' = none)
-- Returns the iids given, in order.
local m = (#ARGV - 5) / 5
local first = tonumber(redis.call('GET', KEYS[2]) or '0')
if (first + m) * S > 4294967296 then
  return redis.error_reply('GMMLSH internal id space (uint32) of this shard is exhausted')
end
local staged, order = {}, {}
local function put(seq, fam, blob)
  if blob == '' then return end
  local k, f = loc(seq, fam)
  local t = staged[k]
  if not t then t = {}; staged[k] = t; order[#order + 1] = k end
  t[#t + 1] = f; t[#t + 1] = blob
end
local added, retired, out, idmap = 0, 0, {}, {}
for j = 0, m - 1 do
  local a = 6 + 5 * j
  local name = ARGV[a]
  local old = redis.call('HGET', KEYS[1], name)
  if old then
    retire(old)
    retired = retired + 1
  else
    added = added + 1
  end
  local seq = first + j
  local iid = seq * S + s
  put(seq, 'n', name); put(seq, 'v', ARGV[a + 1]); put(seq, 'k', ARGV[a + 2])
  put(seq, 'f', ARGV[a + 3]); put(seq, 'm', ARGV[a + 4])
  idmap[#idmap + 1] = name; idmap[#idmap + 1] = iid
  out[#out + 1] = iid
end
for _, k in ipairs(order) do redis.call('HSET', k, unpack(staged[k])) end
redis.call('HSET', KEYS[1], unpack(idmap))
redis.call('SET', KEYS[2], first + m)
if added > 0 then redis.call('INCRBY', KEYS[3], added) end
if retired > 0 then redis.call('INCRBY', KEYS[5], retired) end
return out
