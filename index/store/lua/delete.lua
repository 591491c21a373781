-- Retire ids of one id shard, atomically: their records go, their iids join the feed.
-- KEYS: ids, seq, live, dead, ndead (all of the shard, one hash tag), then optionally the
--       index's epoch key (see bumped in shard.lua)
-- ARGV: the three of shard.lua, the shard's key prefix, '1' if each name is followed by the
-- iid it must still have (else '0'), then the names
-- Returns {how many of the names existed (with the iid expected, if given), the epoch or 0}.
local TAG, EXPECT = ARGV[4], ARGV[5] == '1'
local step = 1
if EXPECT then step = 2 end
local removed = 0
for j = 6, #ARGV, step do
  local old = redis.call('HGET', KEYS[1], ARGV[j])
  if old and (not EXPECT or tonumber(old) == tonumber(ARGV[j + 1])) then
    retire(TAG, KEYS[4], old)
    redis.call('HDEL', KEYS[1], ARGV[j])
    removed = removed + 1
  end
end
if removed > 0 then
  redis.call('DECRBY', KEYS[3], removed)
  redis.call('INCRBY', KEYS[5], removed)
end
return bumped(removed, 5)
