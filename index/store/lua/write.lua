-- Upsert records of one or more id shards, atomically: retire each id's old version,
-- allocate a fresh iid, write the record's fields and point the id at it.
-- KEYS: per shard, in the order of the sections below: ids, seq, live, dead, ndead (one hash tag
--       each; on a Cluster a call holds one shard)
-- ARGV: the three of shard.lua, then one section per shard: s, key prefix of the shard, the
--       number m of its records, then 5 per record: name, vector, sketch, nrff ('' = none),
--       meta ('' = none)
-- KEYS, last and optional: the index's epoch key (see bumped in shard.lua).
-- Returns {how many of the names held a vector before (were replaced), the epoch or 0, then
-- each section's first sequence number}: its j-th record's iid is (first + j) * S + s.
-- One call is all or nothing, a full Redis included: under maxmemory with noeviction, Redis
-- refuses a script's first write that needs memory, and lets a script that has written go on.
local function hset(key, kv)  -- in slices: unpack() is bounded by Lua's C stack
  for i = 1, #kv, 4000 do redis.call('HSET', key, unpack(kv, i, math.min(i + 3999, #kv))) end
end

local sections, a = {}, 4
while a <= #ARGV do
  local sec = {s = tonumber(ARGV[a]), tag = ARGV[a + 1], m = tonumber(ARGV[a + 2]), at = a + 3,
               keys = 5 * #sections}
  sec.first = tonumber(redis.call('GET', KEYS[sec.keys + 2]) or '0')
  if (sec.first + sec.m) * S > 4294967296 then  -- checked for every shard before anything is written
    return redis.error_reply('GMMLSH internal id space (uint32) of this shard is exhausted')
  end
  sections[#sections + 1] = sec
  a = sec.at + 5 * sec.m
end

local replaced, firsts = 0, {}
for _, sec in ipairs(sections) do
  firsts[#firsts + 1] = sec.first
  local TAG, K = sec.tag, sec.keys
  local staged, order = {}, {}
  local function put(seq, fam, blob)
    if blob == '' then return end
    local k, f = loc(TAG, seq, fam)
    local t = staged[k]
    if not t then t = {}; staged[k] = t; order[#order + 1] = k end
    t[#t + 1] = f; t[#t + 1] = blob
  end
  local added, retired, idmap = 0, 0, {}
  for j = 0, sec.m - 1 do
    local r = sec.at + 5 * j
    local name = ARGV[r]
    local old = redis.call('HGET', KEYS[K + 1], name)
    if old then
      retire(TAG, KEYS[K + 4], old)
      retired = retired + 1
    else
      added = added + 1
    end
    local seq = sec.first + j
    put(seq, 'n', name); put(seq, 'v', ARGV[r + 1]); put(seq, 'k', ARGV[r + 2])
    put(seq, 'f', ARGV[r + 3]); put(seq, 'm', ARGV[r + 4])
    idmap[#idmap + 1] = name; idmap[#idmap + 1] = seq * S + sec.s
  end
  for _, k in ipairs(order) do hset(k, staged[k]) end
  hset(KEYS[K + 1], idmap)
  redis.call('SET', KEYS[K + 2], sec.first + sec.m)
  if added > 0 then redis.call('INCRBY', KEYS[K + 3], added) end
  if retired > 0 then redis.call('INCRBY', KEYS[K + 5], retired) end
  replaced = replaced + retired
end
return bumped(replaced, 5 * #sections, firsts)
