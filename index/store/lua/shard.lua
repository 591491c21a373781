-- Prepended to every script of this folder (RedisStore._script): the arguments every script
-- starts with, where a record's fields live and how a record is retired. RedisStore._loc is
-- the same location rule in Python; tests/test_redis_store.py runs this one in Redis and
-- checks that the two agree.
-- ARGV[1..3]: S (shards), chunk_big, chunk_small.
local S, CB, CS = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
-- A record's fields: n name, v vector, k sketch, f NRFF features, m metadata.
local FAMILIES = {'n', 'v', 'k', 'f', 'm'}
-- Small fields share a hash with fewer others (it stays in Redis' compact encoding).
local SMALL = {n = true, m = true}
-- Field fam of the record with shard sequence number seq, in the shard of key prefix tag: its
-- hash key and the field in it.
local function loc(tag, seq, fam)
  local c = CB
  if SMALL[fam] then c = CS end
  return tag .. fam .. ':' .. math.floor(seq / c), tostring(seq % c)
end
-- Retire the record of iid old in the shard of key prefix tag: its fields go, its iid joins
-- the shard's feed of retired iids (key feed). The caller updates the counts.
local function retire(tag, feed, old)
  local seq = math.floor(tonumber(old) / S)
  for _, fam in ipairs(FAMILIES) do
    local k, f = loc(tag, seq, fam)
    redis.call('HDEL', k, f)
  end
  redis.call('RPUSH', feed, old)
end
-- The script's reply: its own value and the index's epoch, bumped last where the caller gave
-- the epoch key as the last of KEYS (one server: a script that has written runs to its end even
-- in a full Redis, which refuses an INCR sent on its own after it), else 0 (a Cluster bumps it
-- in a command of its own: a script's keys share one slot); then the values of extra, if given.
local function bumped(value, nkeys, extra)
  local out = {value, 0}
  if #KEYS > nkeys then out[2] = redis.call('INCR', KEYS[#KEYS]) end
  for _, x in ipairs(extra or {}) do out[#out + 1] = x end
  return out
end
