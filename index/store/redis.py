"""The Redis backend: one index under one key prefix, shared by many stateless API replicas.

Key layout (``P`` = prefix, ``s`` = id shard, ``t`` = bucket group)
-------------------------------------------------------------------
* ``{P}:config`` — index configuration (JSON); ``{P}:layout`` — this store's
  layout (JSON: shard count, bucket groups, chunk sizes), fixed at first write.
* ``{P}:allocs`` — on a single server, the number of iids handed out in all
  shards together (the sum of every ``seq`` below, kept by the same script that
  moves a ``seq``). A query asks "did another process add vectors?" by reading
  this one key instead of all ``S`` sequences. Layouts created on a Cluster (or
  by layout version 1) have no such key: a script there cannot reach it
  atomically, and readers sum the sequences instead.
* ``{P}:retires`` — on a single server (layout 3), how many committed iids have
  died (replaced or deleted), counted by the script that kills them. While it
  stands still every name a reader has seen is still live, so a reader may
  answer from its cache of names and metadata after one ``MGET`` of ``allocs``
  and ``retires``, instead of reading its neighbours' records.
* Per id shard ``s = crc32(external id) mod S`` (default ``S = 64``), all under
  the hash tag ``{P:s}`` so that one Lua script can touch them atomically,
  also on a Redis Cluster:

  - ``{P:s}:ids``  hash  external id → iid (the **commit point**)
  - ``{P:s}:seq``  counter of iids handed out in this shard
  - ``{P:s}:n``    number of live vectors in this shard (``count()`` is exact)
  - ``{P:s}:pend`` hash  external id → write-ahead entries of uncommitted
    attempts (iid, start time, sketch): what a crashed writer left behind
  - ``{P:s}:gc``   hash  iid → sketch of dead iids whose bucket entries may
    still exist (journal of pending bucket clean-up)
  - ``{P:s}:<f>:<c>`` hash  ``seq mod C`` → blob, for field ``f`` in
    ``v`` (vector), ``k`` (sketch), ``f`` (nrff), ``m`` (meta), ``x`` (external
    id); chunk ``c = seq // C``. Blobs live in hashes rather than one key per
    vector: a key costs ~70 bytes of overhead, a hash field ~40 (and small
    hashes stay listpack-encoded, ~10 bytes a field).

  An iid is ``seq · S + s``: it names its shard, iids stay dense
  (``iid_bound() ≈ count``), and every iid is handed out once (never reused),
  so a record under an iid is immutable and readers may cache it.
* Buckets: hash ``P:b:<t>`` (bucket group ``t = fnv1a64(band key) mod G``,
  default ``G = 4096``), field = band key, value = the bucket's iids as packed
  little-endian uint32. Why:

  - a key costs ~90 bytes of overhead, a hash field ~15 (listpack-encoded
    small hash) to ~60 (hashtable): LSH makes tens of distinct buckets per
    vector on unclustered data, so one key per bucket alone would cost
    ~3 KB/vector (measured, 64 bands);
  - packed strings, not sets: 4 bytes per entry with no encoding cliff (a set
    goes from intset to hashtable at 512 members, ~50 bytes per member), and a
    query decodes every bucket it reads with one ``np.frombuffer``;
  - a group is one key, so one script call updates all of a batch's buckets
    in that group atomically, on a Cluster too; the groups spread over slots.
    On a single server one call takes many groups (up to ``_CALL_BUCKETS``
    buckets): a batch of 1,000 vectors is ~20 calls instead of ~4,000, and the
    script reads and writes each group with one HMGET and one HSET.
    ``G`` is fixed when the index is created; for indexes far beyond a million
    vectors a larger ``bucket_groups`` keeps the group hashes smaller.
* Spilled buckets (layout 4, single server): a bucket longer than ``spill``
  bytes (default 512: 128 iids) moves to its own string key
  ``{P:b:<t>}<band key>``, and its field keeps ``''`` as a marker. Adding to a
  hash field rewrites the whole value, so a big bucket made every insert O(its
  size) — O(n) per vector as the index grows; a spilled bucket takes an
  ``APPEND``. Few buckets grow that big (of 60,000 Fashion-MNIST vectors' buckets,
  the 1.4 % with ≥ 64 entries hold 59 % of all entries), so the extra keys cost
  little memory. The scripts reach spilled keys without declaring them, which only
  a single server allows (a spilled key does share its group's slot).
* ``{P}:r:<random>`` — receipts (layout 4, single server): every bucket-addition
  call first sets its own receipt (``SET NX``, expiring after ``max(120 s, 10 ×
  socket timeout)``); a call that finds its receipt set is a replay and adds
  nothing. ``APPEND`` cannot skip an iid already present, as the older
  layouts' check did by searching the bucket. On a Cluster a call covers one
  group, so receipts would cost a key per group per batch: Cluster layouts
  neither spill nor take receipts.

Write protocol (upsert): 3 round trips for new ids, 5 when records get replaced
-------------------------------------------------------------------------------
(per chunk of ``write_chunk`` records, whatever the number of shards or buckets)

1. *begin* (one script per shard): allocate iids (``INCRBY``), journal each
   record in ``pend`` (iid + sketch), return the current iid of each id and
   some ``gc`` entries left by earlier writers.
2. add the new bucket entries (and remove those of the ``gc`` entries).
3. *commit* (one script per shard, atomic): write all blobs of the record,
   point ``ids`` at the new iid, move the old iid to ``gc`` and delete its
   blobs, cancel other attempts journaled for the same id (a crashed writer's),
   clear the ``gc`` entries cleaned in step 2.
4. remove the bucket entries of the iids that died in step 3; 5. clear their
   ``gc`` entries.

On a single server, a single record is one script (``put1``): iid, bucket
entries, blobs and id map together, atomic, so no journal — 1 round trip for a
new id (3 for a replacement: then steps 4 and 5). Other chunks whose records all
fall in one shard and whose bucket additions fit one call run steps 2 and 3 as
one script: 2 round trips.

So a reader sees a vector only once all its blobs *and* all its bucket entries
exist; before the commit or after a replacement a bucket may name an iid whose
record is gone, and :meth:`fetch` / :meth:`external_ids` return None for it
(the index skips those). After a crash anywhere, what is left over is journaled
(``pend``, ``gc``) and cleaned by the next write that touches the shard —
retrying the batch completes it with exact counts and no stale bucket entries —
or by :meth:`RedisStore.collect_garbage`. Every write is safe to replay (redis-py
resends a pipeline after a dropped connection): a replayed begin only wastes
iids, a replayed bucket addition finds its receipt (older layouts and Clusters:
skips iids already present), a replayed commit sees itself already applied (only
a replayed delete may under-count what it removed).
Two writers replacing the *same* id at once: the first commit cancels the other
attempt, whose record is dropped — linearised just before the winner, which is
legitimate since the two calls overlapped. A delete (lookup, delete script,
bucket clean-up: 4 round trips) works the same way, with the id map as commit
point; a single id on a single server takes 2 (its iid and sketch, then record,
bucket entries and journal entry in one script, ``del1``).

Durability: the scripts are replicated as ``MULTI/EXEC`` blocks, so the AOF
never holds half a script. With ``appendfsync always`` an acknowledged write
survives a crash; with ``everysec`` (Redis' default) the last second may be lost
— on a single server the AOF is a prefix, so what survives is still consistent;
on a Cluster each master loses its own suffix, so use ``always`` there if a
crash must not leave a vector without some of its bucket entries.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import numpy as np
import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    ClusterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

from gmmlsh.index.store.base import (
    FIELDS,
    BandKeysFn,
    RecordBatch,
    StoreError,
    StoreUnavailable,
    decode_names,
)

__all__ = ["RedisStore"]

LAYOUT_VERSION = 4
#: Layout versions this release reads (1: no server-wide allocation counter; 2: no
#: retirement counter; 3: no spilled buckets, no receipts).
_LAYOUTS_READ = (1, 2, 3, 4)
_IID_LIMIT = 1 << 32
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
#: Chunk sizes: big blobs in hashes of 1024 fields; small ones (external id,
#: metadata) in hashes of 128 so they stay listpack-encoded (Redis' default
#: ``hash-max-listpack-entries``).
_CHUNK_BIG = 1024
_CHUNK_SMALL = 128
_FAMILY = {"vector": "v", "sketch": "k", "nrff": "f", "meta": "m"}
_ALL_FAMILIES = ("v", "k", "f", "m", "x")
#: Buckets of one group per script call segment (a group's HMGET/HSET arguments).
_GROUP_CALL_KEYS = 512
#: Buckets per script call on a single server (bounds the time one call blocks it).
_CALL_BUCKETS = 4096
#: Default bucket length (bytes, 4 per iid) beyond which a bucket spills into its own key.
_SPILL_BYTES = 512
#: Records per internal write chunk (bounds memory and script run time).
_WRITE_CHUNK = 2048
#: gc entries a *begin* hands back per shard for clean-up.
_GC_PER_BEGIN = 256
#: Up to this many iids, :meth:`RedisStore._blob_reads` groups them in plain Python.
_SMALL_READ = 64
_U4 = np.dtype("<u4")
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)

_UNAVAILABLE = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError, AuthenticationError
    redis.exceptions.TimeoutError,
    ClusterDownError,  # includes MasterDownError
    TryAgainError,
    RedisClusterException,  # cannot reach any node, slot not covered
    OSError,
)
#: Error replies that mean "not now" rather than "never": the service answers 503.
_TRANSIENT_REPLIES = ("BUSY", "LOADING", "MASTERDOWN", "READONLY", "OOM", "TRYAGAIN",
                      "CLUSTERDOWN", "NOREPLICAS")


class _Transient(RedisError):
    """An error reply of :data:`_TRANSIENT_REPLIES` (server busy, loading, full, failing over)."""


_UNAVAILABLE = (*_UNAVAILABLE, _Transient)

# --- Lua ---------------------------------------------------------------------------------
# Lua numbers are doubles: iids (< 2^32) are exact, and ``tostring`` of an
# integral double prints it without a decimal point (the Python side builds the
# same key names). ``struct`` and ``TIME`` are available to Redis ≥ 5 scripts.
# Scripts read and write a call's records with one multi-argument command per key
# (a redis.call costs ~1 µs beyond its work); ``many`` slices the arguments, as
# ``unpack`` is limited to a few thousand values.

_LUA_MANY = """
local function many(cmd, key, args)    -- cmd key args..., in slices; replies joined
  local out = {}
  for lo = 1, #args, 4000 do
    local r = redis.call(cmd, key, unpack(args, lo, math.min(#args, lo + 3999)))
    if type(r) == 'table' then for i = 1, #r do out[#out + 1] = r[i] end end
  end
  return out
end
"""

_LUA_HELPERS = _LUA_MANY + """
local S, CB, CS, TAG = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local RETIRES = ARGV[5] == '1'        -- KEYS[5] counts retired iids (layout ≥ 3, one server)
local function loc(iid, fam)
  local seq = math.floor(iid / S)
  local c = CB
  if fam == 'x' or fam == 'm' then c = CS end
  return TAG .. fam .. ':' .. tostring(math.floor(seq / c)), tostring(seq % c)
end
local dead = {}
local function bury(iid, sk)          -- journal a dead iid for bucket clean-up
  redis.call('HSET', KEYS[3], iid, sk)
  dead[#dead + 1] = iid
  dead[#dead + 1] = sk
end
local function kill(iid)              -- a committed record dies: blobs go, sketch to gc
  if RETIRES then redis.call('INCR', KEYS[5]) end
  local kk, kf = loc(iid, 'k')
  local sk = redis.call('HGET', kk, kf)
  if sk then bury(iid, sk) end
  for _, fam in ipairs({'v', 'k', 'f', 'm', 'x'}) do
    local k, f = loc(iid, fam)
    redis.call('HDEL', k, f)
  end
end
-- A journal value is a run of entries: <I4 iid, <I4 start time (s), <I2 n, n sketch bytes.
local function attempts(p)            -- {iid, time, sketch, iid, time, sketch, ...}
  local out, o = {}, 1
  while o <= #p do
    local iid, t, n = struct.unpack('<I4I4I2', p, o)
    out[#out + 1] = iid
    out[#out + 1] = t
    out[#out + 1] = string.sub(p, o + 10, o + 9 + n)
    o = o + 10 + n
  end
  return out
end
local staged, staged_keys = {}, {}   -- chunk key -> {field, blob, ...}: one HSET per key
local function stage(iid, ext, flags, vec, sk, nrff, meta)   -- a record's blobs, to write
  local function put(fam, blob)
    local k, f = loc(iid, fam)
    local t = staged[k]
    if not t then t = {}; staged[k] = t; staged_keys[#staged_keys + 1] = k end
    t[#t + 1] = f; t[#t + 1] = blob
  end
  put('v', vec)
  put('k', sk)
  if string.find(flags, 'f', 1, true) then put('f', nrff) end
  if string.find(flags, 'm', 1, true) then put('m', meta) end
  put('x', ext)
end
local function write_staged()
  for _, k in ipairs(staged_keys) do many('HSET', k, staged[k]) end
end
local function hand_back(limit)       -- also return garbage earlier writers left here
  local n = redis.call('HLEN', KEYS[3])
  if n > #dead / 2 then
    local gc
    if n <= limit then gc = redis.call('HGETALL', KEYS[3])
    else gc = redis.call('HRANDFIELD', KEYS[3], limit, 'WITHVALUES') end
    for i = 1, #gc do dead[#dead + 1] = gc[i] end
  end
end
local function cancel_pending(ext, keep)   -- other attempts for this id die
  local p = redis.call('HGET', KEYS[2], ext)
  if not p then return end
  local a = attempts(p)
  for i = 1, #a, 3 do
    if a[i] ~= keep then bury(a[i], a[i + 2]) end
  end
  redis.call('HDEL', KEYS[2], ext)
end
"""

# KEYS: seq, pend, gc, ids.  ARGV: S, s, gc_max, then (ext, sketch) pairs.
_LUA_BEGIN = _LUA_MANY + """
local S, s, gcmax = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local m = (#ARGV - 3) / 2
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if (cur + m) * S > 4294967296 then
  return redis.error_reply('GMMLSH internal id space (uint32) of this shard is exhausted')
end
local first = redis.call('INCRBY', KEYS[1], m) - m
if #KEYS > 4 then redis.call('INCRBY', KEYS[5], m) end
local now = tonumber(redis.call('TIME')[1])
local exts = {}
for j = 1, m do exts[j] = ARGV[2 + 2 * j] end
local ps, ids = many('HMGET', KEYS[2], exts), many('HMGET', KEYS[4], exts)
local journal, olds = {}, {}
for j = 1, m do
  local sk = ARGV[3 + 2 * j]
  local entry = struct.pack('<I4I4I2', (first + j - 1) * S + s, now, #sk) .. sk
  journal[2 * j - 1] = exts[j]
  journal[2 * j] = (ps[j] or '') .. entry
  olds[j] = tonumber(ids[j] or '-1')
end
many('HSET', KEYS[2], journal)
local gc = {}
local n = redis.call('HLEN', KEYS[3])
if n > 0 then
  if n <= gcmax then gc = redis.call('HGETALL', KEYS[3])
  else gc = redis.call('HRANDFIELD', KEYS[3], gcmax, 'WITHVALUES') end
end
return {first, olds, gc}
"""

# KEYS: ids, pend, gc, n, [retires,] chunk keys (declared).  ARGV: S, CB, CS, TAG,
# retires?, ngc, <ngc cleaned gc iids>, then 8 per record: ext, iid, expected old, flags, vec, sk, nrff, meta.
# Status per record: 1 committed (info: old iid or -1), 2 cancelled, 3 conflict (info: current).
_LUA_COMMIT = _LUA_HELPERS + """
local ngc = tonumber(ARGV[6])
for i = 1, ngc do redis.call('HDEL', KEYS[3], ARGV[6 + i]) end
local base = 7 + ngc
local m = (#ARGV - base + 1) / 8
local exts = {}
for j = 1, m do exts[j] = ARGV[base + 8 * (j - 1)] end
local curs, ps = many('HMGET', KEYS[1], exts), many('HMGET', KEYS[2], exts)
local status, info, added, idmap, settled = {}, {}, 0, {}, {}
for j = 1, m do
  local a = base + 8 * (j - 1)
  local ext, iid, exp, flags = exts[j], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3]
  local cur = tonumber(curs[j] or '-1')
  if cur == iid then                       -- a replay of a commit that already happened
    status[j], info[j] = 1, -1
  else
    local tries, mine = {}, false
    if ps[j] then
      tries = attempts(ps[j])
      for i = 1, #tries, 3 do if tries[i] == iid then mine = true end end
    end
    if not mine then                       -- cancelled by another commit/delete of this id
      bury(iid, ARGV[a + 5])
      status[j], info[j] = 2, -1
    elseif cur ~= exp then                 -- replaced meanwhile: the caller retries with cur
      status[j], info[j] = 3, cur
    else
      for i = 1, #tries, 3 do              -- other attempts for this id die
        if tries[i] ~= iid then bury(tries[i], tries[i + 2]) end
      end
      settled[#settled + 1] = ext
      stage(iid, ext, flags, ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], ARGV[a + 7])
      idmap[#idmap + 1] = ext; idmap[#idmap + 1] = iid
      if cur >= 0 then kill(cur) else added = added + 1 end
      status[j], info[j] = 1, cur
    end
  end
end
if #settled > 0 then many('HDEL', KEYS[2], settled) end
write_staged()
if #idmap > 0 then many('HSET', KEYS[1], idmap) end
if added > 0 then redis.call('INCRBY', KEYS[4], added) end
return {status, info, dead}
"""

# KEYS: ids, pend, gc, n, [retires,] chunk keys of the expected iids.  ARGV: S, CB, CS,
# TAG, retires?, then (ext, expected iid) pairs. Status: 0 absent, 1 deleted, 3 conflict (info: current).
_LUA_DELETE = _LUA_HELPERS + """
local status, info, removed = {}, {}, 0
for j = 0, (#ARGV - 5) / 2 - 1 do
  local ext, exp = ARGV[6 + 2 * j], tonumber(ARGV[7 + 2 * j])
  local cur = tonumber(redis.call('HGET', KEYS[1], ext) or '-1')
  if cur ~= exp then
    status[j + 1], info[j + 1] = 3, cur
  else
    cancel_pending(ext, -1)
    if cur < 0 then
      status[j + 1], info[j + 1] = 0, -1
    else
      redis.call('HDEL', KEYS[1], ext)
      kill(cur)
      removed = removed + 1
      status[j + 1], info[j + 1] = 1, cur
    end
  end
end
if removed > 0 then redis.call('DECRBY', KEYS[4], removed) end
hand_back(512)
return {status, info, dead}
"""

# KEYS: pend, gc.  ARGV: max age (s). Moves attempts older than that to gc.
_LUA_EXPIRE = """
local limit = tonumber(redis.call('TIME')[1]) - tonumber(ARGV[1])
local moved = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local ext, p, o = all[i], all[i + 1], 1
  local keep = {}
  while o <= #p do
    local iid, t, n = struct.unpack('<I4I4I2', p, o)
    if t < limit then
      redis.call('HSET', KEYS[2], iid, string.sub(p, o + 10, o + 9 + n))
      moved = moved + 1
    else
      keep[#keep + 1] = string.sub(p, o, o + 9 + n)
    end
    o = o + 10 + n
  end
  if #keep == 0 then redis.call('HDEL', KEYS[1], ext)
  else redis.call('HSET', KEYS[1], ext, table.concat(keep)) end
end
return moved
"""

# Bucket scripts take bucket groups (hashes, KEYS) and, framed so that the client
# builds a call from a few numpy slices instead of two arguments per bucket:
# ARGV[1] band key length kb, ARGV[2] how many buckets of each group follow (<I4 per
# key), ARGV[3] the band keys back to back, ARGV[4] each bucket's number of iids
# (<I4), ARGV[5] all the iids (<I4), bucket after bucket. A group's fields are read
# with one HMGET and written with one HSET: a redis.call per bucket cost ~1 µs more
# than the bucket's own work. On a single server a call takes many groups; on a
# Cluster one (the groups spread over slots).
_LUA_FRAMES = """
local kb, per, fields, counts, payload = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local off, nb = 1, 0
local function spilled(g, f)          -- a spilled bucket's key: in its group's slot
  return '{' .. KEYS[g] .. '}' .. f
end
local function group(g)               -- group g's band keys and their iids
  local n = struct.unpack('<I4', per, 4 * g - 3)
  local fs, ids = {}, {}
  for j = 1, n do
    local c = struct.unpack('<I4', counts, 4 * nb + 1)
    fs[j] = string.sub(fields, kb * nb + 1, kb * (nb + 1))
    ids[j] = string.sub(payload, off, off + 4 * c - 1)
    off = off + 4 * c
    nb = nb + 1
  end
  return fs, ids, redis.call('HMGET', KEYS[g], unpack(fs))
end
"""

# Layout 4 (single server): a call first sets its receipt (the last of KEYS, with a TTL
# of ARGV[7] s, unless that is 0); finding it already set means the call is a replay,
# which adds nothing. A bucket longer than ARGV[6] bytes moves to its own string key
# (spilled: the field keeps '' as a marker) and later additions APPEND to it, so adding
# to a big bucket costs O(added) instead of a rewrite of the bucket. Older layouts and Clusters (ARGV[6] = 0):
# the iids of one call are new, so finding the first one already there means a replay.
_LUA_BUCKET_ADD = _LUA_FRAMES + """
local spill, ng = tonumber(ARGV[6]), #KEYS
if spill > 0 and tonumber(ARGV[7]) > 0 then
  ng = ng - 1
  if not redis.call('SET', KEYS[#KEYS], '1', 'NX', 'EX', ARGV[7]) then return -1 end
end
for g = 1, ng do
  local fs, adds, curs = group(g)
  local out = {}
  for j = 1, #fs do
    local cur, add = curs[j], adds[j]
    if spill > 0 then
      if cur == '' then
        redis.call('APPEND', spilled(g, fs[j]), add)
      else
        local new = cur and cur .. add or add
        if #new > spill then
          redis.call('SET', spilled(g, fs[j]), new)
          new = ''
        end
        out[#out + 1] = fs[j]; out[#out + 1] = new
      end
    elseif not cur then
      out[#out + 1] = fs[j]; out[#out + 1] = add
    else
      local first, pos, dup = string.sub(add, 1, 4), 1, false
      while true do
        local p = string.find(cur, first, pos, true)
        if not p then break end
        if (p - 1) % 4 == 0 then dup = true; break end
        pos = p + 1
      end
      if not dup then out[#out + 1] = fs[j]; out[#out + 1] = cur .. add end
    end
  end
  if #out > 0 then redis.call('HSET', KEYS[g], unpack(out)) end
end
return nb
"""

# Every copy of an iid goes (there is none, short of a bug, but the clean-up must be total).
# A spilled bucket stays spilled until it is empty.
_LUA_BUCKET_REMOVE = _LUA_FRAMES + """
local removed = 0
for g = 1, #KEYS do
  local fs, rms, curs = group(g)
  local set, gone = {}, {}
  for j = 1, #fs do
    local cur, rm = curs[j], rms[j]
    local big = cur == ''
    if big then cur = redis.call('GET', spilled(g, fs[j])) or '' end
    if cur then
      local out = cur
      if #rm <= 16 then
        for q = 1, #rm, 4 do
          local x, pos = string.sub(rm, q, q + 3), 1
          while true do
            local p = string.find(out, x, pos, true)
            if not p then break end
            if (p - 1) % 4 == 0 then
              out = string.sub(out, 1, p - 1) .. string.sub(out, p + 4)
              removed = removed + 1
              pos = p
            else
              pos = p + 1
            end
          end
        end
      else
        local drop, keep = {}, {}
        for q = 1, #rm, 4 do drop[string.sub(rm, q, q + 3)] = true end
        for q = 1, #cur, 4 do
          local x = string.sub(cur, q, q + 3)
          if drop[x] then removed = removed + 1 else keep[#keep + 1] = x end
        end
        out = table.concat(keep)
      end
      if #out == 0 then
        gone[#gone + 1] = fs[j]
        if big then redis.call('DEL', spilled(g, fs[j])) end
      elseif #out ~= #cur then
        if big then redis.call('SET', spilled(g, fs[j]), out)
        else set[#set + 1] = fs[j]; set[#set + 1] = out end
      end
    end
  end
  if #set > 0 then redis.call('HSET', KEYS[g], unpack(set)) end
  if #gone > 0 then redis.call('HDEL', KEYS[g], unpack(gone)) end
end
return removed
"""

# Read every requested bucket of a query server-side and return them as one packed
# string: one command instead of one HMGET per bucket group (the client-side cost
# of packing ~80 commands per query exceeded the server's). Single server only:
# on a Cluster the group keys live in many slots.
# Spilled buckets (layout 4; their key as in ``spilled`` above) are read with one MGET
# at the end.
# KEYS = group keys; ARGV[i] = how many fields of KEYS[i] follow; then the fields.
_LUA_BGET = """
local out, big = {}, {}
local pos = #KEYS + 1
for i = 1, #KEYS do
  local n = tonumber(ARGV[i])
  local vals = redis.call('HMGET', KEYS[i], unpack(ARGV, pos, pos + n - 1))
  for j = 1, n do
    local v = vals[j]
    if v == '' then big[#big + 1] = '{' .. KEYS[i] .. '}' .. ARGV[pos + j - 1]
    elseif v then out[#out + 1] = v end
  end
  pos = pos + n
end
if #big > 0 then
  for _, v in ipairs(redis.call('MGET', unpack(big))) do
    if v then out[#out + 1] = v end
  end
end
return table.concat(out)
"""

# An answer's reads on a single server: HMGETs of chunk hashes plus some counters
# (``allocs`` and ``retires``, or on a layout-1 index the shard sequences: for
# :meth:`RedisStore.ids_fetch_and_news`) as one command. Packing and parsing ~20
# pipelined commands in redis-py cost more than the server's work. KEYS = n hash keys,
# then the counters; ARGV[1] = n, ARGV[1 + i] = how many fields of KEYS[i] follow, then
# the fields. Returns {values (false: absent), counter values (false: absent)}.
_LUA_READS = """
local n = tonumber(ARGV[1])
local out, pos = {}, n + 2
for i = 1, n do
  local c = tonumber(ARGV[i + 1])
  local vals = redis.call('HMGET', KEYS[i], unpack(ARGV, pos, pos + c - 1))
  for j = 1, c do out[#out + 1] = vals[j] end
  pos = pos + c
end
local counters = {}
if #KEYS > n then counters = redis.call('MGET', unpack(KEYS, n + 1, #KEYS)) end
return {out, counters}
"""

#: A small write on a single server: step 2 (bucket additions, one call) and step 3
#: (the commit of one shard) as one script, so one round trip fewer. ARGV[1], ARGV[2]:
#: how many of KEYS and of the remaining ARGV are the bucket call's; the rest the commit's.
_LUA_ADD_AND_COMMIT = (
    "local function add_buckets(KEYS, ARGV)\n" + _LUA_BUCKET_ADD + "end\n"
    + "local function commit(KEYS, ARGV)\n" + _LUA_COMMIT + "end\n"
    + """
local nk, na = tonumber(ARGV[1]), tonumber(ARGV[2])
add_buckets({unpack(KEYS, 1, nk)}, {unpack(ARGV, 3, 2 + na)})
return commit({unpack(KEYS, nk + 1)}, {unpack(ARGV, 3 + na)})
"""
)

#: A single record on a single server, whole in one script: allocate its iid, add its
#: bucket entries, write its blobs, point its id at it, kill the version it replaces.
#: Atomic, so it needs no journal; a replay is the same upsert again (a new iid replaces
#: the first, whose entries the caller buries), so it needs no receipt either.
#: KEYS: ids, pend, gc, n, retires, seq, allocs, then the bucket groups.
#: ARGV: S, CB, CS, TAG, retires?, s, gc_max, number of groups, ext, flags, vec, sk,
#: nrff, meta, then the bucket call's kb, per, fields, counts, spill.
_LUA_PUT_ONE = (
    "local function add_buckets(KEYS, ARGV)\n" + _LUA_BUCKET_ADD + "end\n" + _LUA_HELPERS
    + """
local s, gcmax, ng = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local ext, flags = ARGV[9], ARGV[10]
local seq = tonumber(redis.call('GET', KEYS[6]) or '0')
if (seq + 1) * S > 4294967296 then
  return redis.error_reply('GMMLSH internal id space (uint32) of this shard is exhausted')
end
seq = redis.call('INCRBY', KEYS[6], 1) - 1
redis.call('INCRBY', KEYS[7], 1)
local iid = seq * S + s
local entries = 0                     -- every bucket entry is this iid
for q = 1, #ARGV[18], 4 do entries = entries + struct.unpack('<I4', ARGV[18], q) end
add_buckets({unpack(KEYS, 8, 7 + ng)}, {ARGV[15], ARGV[16], ARGV[17], ARGV[18],
            string.rep(struct.pack('<I4', iid), entries), ARGV[19], 0})
local cur = tonumber(redis.call('HGET', KEYS[1], ext) or '-1')
cancel_pending(ext, -1)
stage(iid, ext, flags, ARGV[11], ARGV[12], ARGV[13], ARGV[14])
write_staged()
redis.call('HSET', KEYS[1], ext, iid)
if cur >= 0 then kill(cur) else redis.call('INCRBY', KEYS[4], 1) end
hand_back(gcmax)
return {iid, cur, dead}
"""
)

#: A single id's current iid and sketch (what :meth:`RedisStore._delete_one` needs to
#: name its buckets). KEYS: ids.  ARGV: S, CB, CS, TAG, '0', ext.
_LUA_LOOK_ONE = _LUA_HELPERS + """
local iid = redis.call('HGET', KEYS[1], ARGV[6])
if not iid then return {-1, false} end
local k, f = loc(tonumber(iid), 'k')
return {tonumber(iid), redis.call('HGET', k, f)}
"""

#: A single id's delete on a single server, whole in one script: the record, its bucket
#: entries (named by the caller from the sketch it read) and its journal entry go
#: together. Status 3 (info: current iid) when the id no longer names that iid.
#: KEYS: ids, pend, gc, n, retires, then the bucket groups.  ARGV: S, CB, CS, TAG,
#: retires?, ext, expected iid, number of groups, then the bucket call's five arguments.
_LUA_DELETE_ONE = (
    "local function remove_buckets(KEYS, ARGV)\n" + _LUA_BUCKET_REMOVE + "end\n"
    + _LUA_HELPERS + """
local ext, exp, ng = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local cur = tonumber(redis.call('HGET', KEYS[1], ext) or '-1')
if cur ~= exp then return {3, cur, {}} end
cancel_pending(ext, -1)
redis.call('HDEL', KEYS[1], ext)
kill(cur)
redis.call('DECRBY', KEYS[4], 1)
remove_buckets({unpack(KEYS, 6, 5 + ng)}, {unpack(ARGV, 9, 13)})
redis.call('HDEL', KEYS[3], cur)
local rest = {}                       -- what else died (crashed writers' attempts)
for i = 1, #dead, 2 do
  if dead[i] ~= cur then rest[#rest + 1] = dead[i]; rest[#rest + 1] = dead[i + 1] end
end
return {1, cur, rest}
"""
)

_SCRIPTS = {
    "bget": _LUA_BGET,
    "reads": _LUA_READS,
    "begin": _LUA_BEGIN,
    "commit": _LUA_COMMIT,
    "delete": _LUA_DELETE,
    "expire": _LUA_EXPIRE,
    "badd": _LUA_BUCKET_ADD,
    "badd+commit": _LUA_ADD_AND_COMMIT,
    "put1": _LUA_PUT_ONE,
    "look1": _LUA_LOOK_ONE,
    "del1": _LUA_DELETE_ONE,
    "brem": _LUA_BUCKET_REMOVE,
}


# --- helpers -----------------------------------------------------------------------------


def mask_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (safe for logs, errors and /stats)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    except ValueError:
        return "<unparseable redis url>"


def _eval_parts(cmd: tuple) -> tuple[tuple, tuple]:
    """(KEYS, ARGV) of a command built by :meth:`RedisStore._eval`."""
    n = cmd[2]
    return cmd[3:3 + n], cmd[3 + n:]


def _shard_of(ext_id: str, shards: int) -> int:
    """Id shard of an external id: stable across processes and releases (CRC-32 of UTF-8)."""
    return zlib.crc32(ext_id.encode("utf-8")) % shards


def _groups_of(keys: np.ndarray, groups: int) -> np.ndarray:
    """Bucket group of each band key (rows of uint8): FNV-1a 64 mod ``groups``, vectorised."""
    h = np.full(keys.shape[0], _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for col in range(keys.shape[1]):
            h ^= keys[:, col].astype(np.uint64)
            h *= _FNV_PRIME
    return (h % np.uint64(groups)).astype(np.int64)


def _key_words(keys: np.ndarray) -> np.ndarray:
    """Band keys (rows of uint8) as rows of uint64 words, zero-padded: sorting by the
    words groups equal keys with a few sort keys instead of one per byte."""
    n, kb = keys.shape
    padded = np.zeros((n, -(-kb // 8) * 8), dtype=np.uint8)
    padded[:, :kb] = keys
    return padded.view(np.uint64)


def _blob_flags(has_nrff: bool, meta: bytes | None) -> str:
    """The optional blobs a record's script writes: ``f`` (NRFF features), ``m`` (metadata)."""
    return ("f" if has_nrff else "") + ("m" if meta is not None else "")


def _pairs(flat: list) -> list[tuple[int, bytes]]:
    """A script's flat (iid, sketch, iid, sketch, ...) reply as (iid, sketch) pairs."""
    return [(int(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]


def _rows(a: np.ndarray) -> list[bytes]:
    """Rows of a 2-D array as ``bytes`` each (no per-row Python arithmetic)."""
    a = np.ascontiguousarray(a)
    if a.shape[0] == 0:
        return []
    width = a.shape[1] * a.itemsize
    if width == 0:
        return [b""] * a.shape[0]
    return [bytes(r) for r in a.view(np.uint8).reshape(a.shape[0], width).view(f"V{width}").ravel()]


def _as_key_array(keys: Sequence[bytes] | np.ndarray) -> list[np.ndarray]:
    """Band keys → 2-D uint8 arrays, one per key length (one index uses one length)."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 2:
            raise ValueError(f"keys: need a (n, key_bytes) array, got shape {keys.shape}")
        return [np.ascontiguousarray(keys, dtype=np.uint8)] if keys.shape[0] else []
    by_len: dict[int, list[bytes]] = defaultdict(list)
    for k in keys:
        by_len[len(k)].append(bytes(k))
    return [np.frombuffer(b"".join(v), np.uint8).reshape(len(v), n)
            for n, v in sorted(by_len.items()) if n > 0]


def _unavailable(fn: Callable) -> Callable:
    """Translate connection-level failures into :class:`StoreUnavailable` (password masked)."""

    @functools.wraps(fn)
    def wrapper(self: RedisStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except (*_UNAVAILABLE, ResponseError) as e:
            raise self._translate(e) from None

    return wrapper


# --- the store -------------------------------------------------------------------------


class RedisStore:
    """Redis implementation of :class:`index.store.Store` (standalone server or Cluster).

    ``url``: ``redis://[user:password@]host:port[/db]`` or ``rediss://`` (TLS).
    ``prefix`` names the index (letters, digits, ``_ . -``): several indexes share
    one Redis. ``cluster``: True / False, or None to ask the server. ``shards``
    (id shards), ``bucket_groups`` and ``spill_bytes`` (bucket length beyond which
    a bucket moves to its own key; single server only) only matter when the index
    is created; afterwards the stored layout wins. ``client_kwargs`` go to redis-py.

    Nothing connects in the constructor: a store can be built while Redis is
    down, every call raises :class:`StoreUnavailable` until it is back, and the
    next call after that reconnects by itself. Needs Redis ≥ 7.0 (``SET NX GET``).
    Default server settings suffice (raising ``hash-max-listpack-value`` to hold
    vectors in listpacks saves only ~3 %: big listpacks lose it to allocator
    rounding).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "gmmlsh",
        cluster: bool | None = None,
        socket_timeout: float = 5.0,
        shards: int = 64,
        bucket_groups: int = 4096,
        write_chunk: int = _WRITE_CHUNK,
        spill_bytes: int = _SPILL_BYTES,
        **client_kwargs: Any,
    ) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url: expected redis://, rediss:// or unix://, got {mask_url(url)!r}")
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix: must be 1-64 of [A-Za-z0-9_.-], got {prefix!r}")
        if not 1 <= shards <= 4096:
            raise ValueError(f"shards: must be between 1 and 4096, got {shards}")
        if not 1 <= bucket_groups <= 1 << 20:
            raise ValueError(f"bucket_groups: must be between 1 and 2^20, got {bucket_groups}")
        if write_chunk < 1:
            raise ValueError(f"write_chunk: must be ≥ 1, got {write_chunk}")
        if spill_bytes < 4 or spill_bytes % 4:
            raise ValueError(f"spill_bytes: must be a positive multiple of 4, got {spill_bytes}")
        client_kwargs.pop("decode_responses", None)  # the store speaks bytes
        self.url = url
        self.prefix = prefix
        self._want_cluster = cluster
        self._socket_timeout = socket_timeout
        self._client_kwargs = client_kwargs
        self._new_layout = {"version": LAYOUT_VERSION, "shards": shards, "groups": bucket_groups,
                            "chunk_big": _CHUNK_BIG, "chunk_small": _CHUNK_SMALL,
                            "spill": spill_bytes}
        # A receipt must outlive every replay of its call: redis-py's one retry comes
        # within a socket timeout or two.
        self._receipt_ttl = max(120, int(10 * socket_timeout))
        self.write_chunk = write_chunk
        self._lock = threading.Lock()
        self._client: Any = None
        self._is_cluster = False
        self._closed = False
        self._shas = {name: _sha1(body) for name, body in _SCRIPTS.items()}
        self._layout: dict | None = None
        self._config_key = f"{{{prefix}}}:config"
        self._layout_key = f"{{{prefix}}}:layout"
        self._allocs_key = f"{{{prefix}}}:allocs".encode()
        self._retires_key = f"{{{prefix}}}:retires".encode()
        self._bucket_prefix = f"{prefix}:b:".encode()
        self._receipt_prefix = f"{{{prefix}}}:r:".encode()
        self._gkeys: list[bytes] = []
        self._seq_key_list: list[bytes] = []

    # --- plumbing ------------------------------------------------------------------------
    def _translate(self, e: BaseException) -> StoreError:
        """A redis-py failure as the store's exception: unavailable (503) or a plain error."""
        if isinstance(e, ResponseError) and not isinstance(e, ClusterDownError | TryAgainError):
            text = str(e)
            if not (text.startswith(_TRANSIENT_REPLIES)
                    or isinstance(e, OutOfMemoryError | ReadOnlyError)):
                return StoreError(f"Redis at {mask_url(self.url)} refused a command: {text}")
        return self._down(e)

    def _down(self, e: BaseException) -> StoreUnavailable:
        msg = str(e)
        try:
            pw = urlsplit(self.url).password
        except ValueError:
            pw = None
        for secret in {pw, unquote(pw)} if pw else ():
            msg = msg.replace(secret, "***")
        kind = "" if isinstance(e, _Transient) else f"{type(e).__name__}: "
        return StoreUnavailable(f"Redis at {mask_url(self.url)} unavailable: {kind}{msg}")

    def _make_client(self) -> Any:
        kw = dict(self._client_kwargs)
        kw.setdefault("socket_timeout", self._socket_timeout)
        kw.setdefault("socket_connect_timeout", min(self._socket_timeout, 2.0))
        # One quick retry (a pooled connection may predate a server restart); every
        # write of this store is safe to replay, see the module docstring.
        retry = Retry(ExponentialBackoff(cap=0.05, base=0.01), 1)
        cluster = self._want_cluster
        if cluster is None:
            probe = redis.Redis.from_url(self.url, decode_responses=False, retry=retry, **kw)
            try:
                cluster = bool(probe.info("cluster").get("cluster_enabled"))
            except ResponseError:  # INFO disabled (some managed services): not a cluster
                cluster = False
            finally:
                probe.close()
        if cluster:
            client = redis.RedisCluster.from_url(self.url, decode_responses=False, retry=retry,
                                                 **kw)
        else:
            client = redis.Redis.from_url(self.url, decode_responses=False, retry=retry, **kw)
        self._is_cluster = bool(cluster)
        return client

    def _r(self) -> Any:
        """The redis-py client, created on first use (after a failed attempt, again)."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"Redis store {self.prefix!r} at {mask_url(self.url)} "
                                       "is closed")
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _pipeline(self, commands: list[tuple]) -> list[Any]:
        """Run commands in one pipelined round trip (per node); results in order.

        A script missing from the server's cache (restart, failover, SCRIPT FLUSH)
        is loaded and its commands — which did not run — are sent again.
        """
        if not commands:
            return []
        r = self._r()
        pending = list(range(len(commands)))
        results: list[Any] = [None] * len(commands)
        for attempt in range(3):
            pipe = r.pipeline(transaction=False)
            for i in pending:
                pipe.execute_command(*commands[i])
            out = pipe.execute(raise_on_error=False)
            missing = []
            for i, res in zip(pending, out, strict=True):
                if isinstance(res, NoScriptError):
                    missing.append(i)
                elif isinstance(res, _UNAVAILABLE):
                    raise res
                elif isinstance(res, ResponseError):
                    text = str(res)
                    if "GMMLSH" in text:
                        raise StoreError(text.split("GMMLSH", 1)[1].strip())
                    if isinstance(res, ClusterDownError | TryAgainError):
                        raise res
                    if text.startswith(_TRANSIENT_REPLIES) or isinstance(res, OutOfMemoryError
                                                                         | ReadOnlyError):
                        raise _Transient(f"{type(res).__name__}: {text}")
                    raise StoreError(f"Redis at {mask_url(self.url)} refused "
                                     f"{commands[i][0]}: {res}")
                elif isinstance(res, Exception):
                    raise res
                else:
                    results[i] = res
            if not missing:
                return results
            if attempt == 2:
                break
            self._load_scripts()
            pending = missing
        raise StoreError(f"Redis at {mask_url(self.url)} keeps forgetting this store's scripts")

    def _load_scripts(self) -> None:
        r = self._r()
        for name, body in _SCRIPTS.items():
            sha = r.script_load(body)
            if isinstance(sha, bytes):
                sha = sha.decode()
            if sha != self._shas[name]:
                raise StoreError(f"Redis hashed script {name} to {sha}, expected {self._shas[name]}")

    def _eval(self, name: str, keys: Sequence, args: Sequence) -> tuple:
        return ("EVALSHA", self._shas[name], len(keys), *keys, *args)

    def _get_layout(self, create: bool) -> dict | None:
        """The stored layout (cached once seen); with ``create``, store ours if none is."""
        if self._layout is not None:
            return self._layout
        r = self._r()
        raw = r.get(self._layout_key)
        if raw is None and create:
            # the allocation and retirement counters need every begin / commit / delete
            # script to reach them, and receipts every key of a bucket call: one server only
            one = not self._is_cluster
            new = dict(self._new_layout, allocs=one, retires=one)
            if not one:
                new["spill"] = 0
            mine = json.dumps(new, sort_keys=True)
            raw = r.set(self._layout_key, mine, nx=True, get=True) or mine.encode()
        if raw is None:
            return None
        try:
            layout = json.loads(raw)
        except ValueError as e:
            raise StoreError(f"Redis index {self.prefix!r}: unreadable layout {raw[:80]!r}") from e
        if layout.get("version") not in _LAYOUTS_READ:
            raise StoreError(f"Redis index {self.prefix!r} has store layout version "
                             f"{layout.get('version')!r}; this release reads "
                             f"{', '.join(map(str, _LAYOUTS_READ))}")
        layout.setdefault("allocs", False)
        layout.setdefault("retires", False)
        layout.setdefault("spill", 0)
        if layout["allocs"] and self._is_cluster:
            raise StoreError(f"Redis index {self.prefix!r} was created on a single server: its "
                             "server-wide allocation counter cannot be kept on a Cluster "
                             "(a script there reaches one slot only); serve it from one server")
        self._layout = layout
        return layout

    def _retire_counting(self, lay: dict) -> tuple[str, list[bytes]]:
        """The commit / delete scripts' retirement-counter argument and key (layout ≥ 3)."""
        return ("1", [self._retires_key]) if lay["retires"] else ("0", [])

    def _tag(self, s: int) -> str:
        return f"{{{self.prefix}:{s}}}:"

    def _shard_keys(self, s: int) -> tuple[str, str, str, str, str]:
        t = self._tag(s)
        return t + "ids", t + "pend", t + "gc", t + "n", t + "seq"

    @staticmethod
    def _chunk(fam: str, lay: dict) -> int:
        return lay["chunk_small"] if fam in ("x", "m") else lay["chunk_big"]

    def _locs(self, iids: np.ndarray, fam: str, lay: dict) -> tuple[np.ndarray, np.ndarray,
                                                                   np.ndarray]:
        """(shard, chunk, field) of each iid's blob in family ``fam``."""
        S = lay["shards"]
        C = self._chunk(fam, lay)
        seq = iids // S
        return iids % S, seq // C, seq % C

    def _chunk_keys(self, iids: Sequence[int], lay: dict, s: int) -> list[str]:
        """Every chunk key (all families) the blobs of these iids live in: a script's KEYS."""
        out: set[str] = set()
        tag = self._tag(s)
        S = lay["shards"]
        for iid in iids:
            if iid < 0:
                continue
            seq = iid // S
            for fam in _ALL_FAMILIES:
                out.add(f"{tag}{fam}:{seq // self._chunk(fam, lay)}")
        return sorted(out)

    def _group_key(self, t: int) -> bytes:
        return self._bucket_prefix + str(t).encode()

    def _group_keys(self, lay: dict) -> list[bytes]:
        """Every group key, indexed by group (built once per store)."""
        if len(self._gkeys) != lay["groups"]:
            self._gkeys = [self._group_key(t) for t in range(lay["groups"])]
        return self._gkeys

    @staticmethod
    def _spill_key(group_key: bytes, band_key: bytes) -> bytes:
        """Where a spilled bucket lives (layout 4): outside ``P:b:*``, in its group's slot."""
        return b"{" + group_key + b"}" + band_key

    # --- configuration ---------------------------------------------------------------------
    @_unavailable
    def read_config(self) -> dict | None:
        """The stored index configuration, or None for a new (empty) store."""
        raw = self._r().get(self._config_key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise StoreError(f"Redis index {self.prefix!r}: unreadable config") from e

    @_unavailable
    def init_config(self, config: dict) -> dict:
        """Store ``config`` if none is stored yet; return what is stored (one atomic SET NX GET)."""
        raw = json.dumps(config, sort_keys=True)
        old = self._r().set(self._config_key, raw, nx=True, get=True)
        self._get_layout(create=True)
        if old is None:
            return json.loads(raw)
        try:
            return json.loads(old)
        except ValueError as e:
            raise StoreError(f"Redis index {self.prefix!r} holds an unreadable config") from e

    # --- writes ------------------------------------------------------------------------------
    @_unavailable
    def upsert(self, batch: RecordBatch, band_keys_of: BandKeysFn) -> None:
        """Insert or replace every record (last occurrence of an id wins); see the module doc.

        Large batches go in chunks of ``write_chunk`` records; each record becomes
        visible atomically, and after a failure the batch can simply be retried.
        """
        n = len(batch)
        batch.check()
        if n == 0:
            return
        lay = self._get_layout(create=True)
        last: dict[str, int] = {}
        for i, ext_id in enumerate(batch.ids):
            last[ext_id] = i
        rows = np.fromiter(sorted(last.values()), dtype=np.int64, count=len(last))
        for lo in range(0, len(rows), self.write_chunk):
            self._upsert_rows(batch, rows[lo:lo + self.write_chunk], band_keys_of, lay)

    def _upsert_rows(self, batch: RecordBatch, rows: np.ndarray, band_keys_of: BandKeysFn,
                     lay: dict) -> None:
        if len(rows) == 1 and lay["allocs"] and self._put_one(batch, int(rows[0]), band_keys_of,
                                                             lay):
            return
        S = lay["shards"]
        sketches = np.ascontiguousarray(np.asarray(batch.sketches)[rows], dtype=np.uint8)
        sk_bytes = _rows(sketches)
        exts = [batch.ids[i] for i in rows.tolist()]
        has_nrff = batch.has_nrff
        nrff = _rows(np.asarray(batch.nrff, dtype="<f4")[rows]) if has_nrff else None
        metas = [batch.meta[i] for i in rows.tolist()] if batch.meta is not None else None
        by_shard: dict[int, list[int]] = defaultdict(list)
        for p, e in enumerate(exts):
            by_shard[_shard_of(e, S)].append(p)
        shards = sorted(by_shard)

        # 1. begin: iids, write-ahead journal, current iids, leftover garbage.
        cmds = []
        for s in shards:
            ids_k, pend_k, gc_k, _, seq_k = self._shard_keys(s)
            args: list[Any] = [S, s, _GC_PER_BEGIN]
            for p in by_shard[s]:
                args += [exts[p].encode(), sk_bytes[p]]
            allocs = [self._allocs_key] if lay["allocs"] else []
            cmds.append(self._eval("begin", [seq_k, pend_k, gc_k, ids_k, *allocs], args))
        iids = np.empty(len(exts), dtype=np.int64)
        expected = np.empty(len(exts), dtype=np.int64)
        gc_found: dict[int, list[tuple[int, bytes]]] = {}
        for s, (first, olds, gc) in zip(shards, self._pipeline(cmds), strict=True):
            ps = by_shard[s]
            iids[ps] = (int(first) + np.arange(len(ps))) * S + s
            expected[ps] = [int(o) for o in olds]
            gc_found[s] = _pairs(gc)

        # 2. bucket entries of the new iids (and of garbage others left behind).
        keys = np.asarray(batch.band_keys)[rows]
        n_bands = keys.shape[1]
        flat = np.ascontiguousarray(keys.reshape(-1, keys.shape[2]), dtype=np.uint8)
        cmds = self._bucket_cmds("badd", flat, np.repeat(iids, n_bands), lay)
        garbage = [g for s in shards for g in gc_found[s]]
        cmds += self._dead_bucket_cmds(garbage, band_keys_of, lay)
        # one shard, one bucket call, nothing to clean (a few records, or one on a layout-1
        # index; a single record otherwise takes put1), on a single server: the bucket call
        # runs inside the commit script (one round trip fewer)
        single = not self._is_cluster and len(shards) == 1 and not garbage and len(cmds) == 1
        fused = cmds[0] if single else None
        if fused is None:
            self._pipeline(cmds)

        # 3. commit (per shard, atomic), retrying records whose id changed meanwhile.
        ret_flag, ret_keys = self._retire_counting(lay)
        todo = {s: list(by_shard[s]) for s in shards}
        cleaned = {s: [g for g, _ in gc_found[s]] for s in shards}
        dead: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
        cancelled: list[int] = []
        for _round in range(32):
            cmds, order = [], []
            for s, ps in todo.items():
                ids_k, pend_k, gc_k, n_k, _ = self._shard_keys(s)
                touched = [int(iids[p]) for p in ps] + [int(expected[p]) for p in ps]
                ckeys = self._chunk_keys(touched, lay, s)
                args = [S, lay["chunk_big"], lay["chunk_small"], self._tag(s), ret_flag,
                        len(cleaned[s]), *cleaned[s]]
                for p in ps:
                    meta = metas[p] if metas is not None else None
                    flags = _blob_flags(has_nrff, meta)
                    args += [exts[p].encode(), int(iids[p]), int(expected[p]), flags,
                             batch.vectors[rows[p]], sk_bytes[p],
                             nrff[p] if nrff is not None else b"", meta or b""]
                cmd = self._eval("commit", [ids_k, pend_k, gc_k, n_k, *ret_keys, *ckeys], args)
                if fused is not None:
                    (bk, ba), (ck, ca) = _eval_parts(fused), _eval_parts(cmd)
                    cmd = self._eval("badd+commit", [*bk, *ck], [len(bk), len(ba), *ba, *ca])
                    fused = None  # a retry round commits only
                cmds.append(cmd)
                order.append(s)
            retry: dict[int, list[int]] = {}
            for s, (status, info, dl) in zip(order, self._pipeline(cmds), strict=True):
                cleaned[s] = []
                dead[s] += _pairs(dl)
                for p, st, cur in zip(todo[s], status, info, strict=True):
                    if st == 3:
                        expected[p] = int(cur)
                        retry.setdefault(s, []).append(p)
                    elif st == 2:
                        cancelled.append(p)
            if not retry:
                break
            todo = retry
        else:
            raise StoreError(f"Redis index {self.prefix!r}: ids kept changing under this write")

        # 4./5. bucket entries of the iids that died (replaced, cancelled attempts).
        self._bury(dead, band_keys_of, lay)

    def _put_one(self, batch: RecordBatch, row: int, band_keys_of: BandKeysFn, lay: dict) -> bool:
        """One record in one script (a single server's index, see ``_LUA_PUT_ONE``): one round
        trip for a new id. False when its buckets need more than one call."""
        S = lay["shards"]
        ext = batch.ids[row]
        s = _shard_of(ext, S)
        keys = np.ascontiguousarray(np.asarray(batch.band_keys)[row], dtype=np.uint8)
        calls = self._bucket_cmds("badd", keys, np.zeros(len(keys), np.int64), lay,
                                  receipt=False)
        if len(calls) != 1:
            return False
        bk, ba = _eval_parts(calls[0])
        meta = batch.meta[row] if batch.meta is not None else None
        has_nrff = batch.has_nrff
        flags = _blob_flags(has_nrff, meta)
        ids_k, pend_k, gc_k, n_k, seq_k = self._shard_keys(s)
        ret_flag, _ = self._retire_counting(lay)
        sketch = np.ascontiguousarray(np.asarray(batch.sketches)[row], dtype=np.uint8).tobytes()
        nrff = np.asarray(batch.nrff[row], dtype="<f4").tobytes() if has_nrff else b""
        cmd = self._eval("put1", [ids_k, pend_k, gc_k, n_k, self._retires_key, seq_k,
                                  self._allocs_key, *bk],
                         [S, lay["chunk_big"], lay["chunk_small"], self._tag(s), ret_flag, s,
                          _GC_PER_BEGIN, len(bk), ext.encode(), flags, batch.vectors[row],
                          sketch, nrff, meta or b"", *ba[:4], ba[5]])
        _, _, dl = self._pipeline([cmd])[0]
        self._bury({s: _pairs(dl)}, band_keys_of, lay)
        return True

    def _bury(self, dead: dict[int, list[tuple[int, bytes]]], band_keys_of: BandKeysFn,
              lay: dict) -> None:
        """Remove the bucket entries of dead iids, then their gc journal entries."""
        allded = [d for lst in dead.values() for d in lst]
        if not allded:
            return
        self._pipeline(self._dead_bucket_cmds(allded, band_keys_of, lay))
        cmds = []
        for s, lst in dead.items():
            if lst:
                cmds.append(("HDEL", self._shard_keys(s)[2], *sorted({i for i, _ in lst})))
        self._pipeline(cmds)

    def _dead_bucket_cmds(self, dead: list[tuple[int, bytes]], band_keys_of: BandKeysFn,
                          lay: dict) -> list[tuple]:
        if not dead:
            return []
        sks = np.stack([np.frombuffer(sk, dtype=np.uint8) for _, sk in dead])
        keys = np.asarray(band_keys_of(sks))
        if keys.ndim != 3 or keys.shape[0] != len(dead):
            raise ValueError(f"band_keys_of returned shape {keys.shape} for {len(dead)} sketches")
        flat = np.ascontiguousarray(keys.reshape(-1, keys.shape[2]), dtype=np.uint8)
        iids = np.repeat(np.array([i for i, _ in dead], dtype=np.int64), keys.shape[1])
        return self._bucket_cmds("brem", flat, iids, lay)

    def _bucket_cmds(self, script: str, flat: np.ndarray, iids: np.ndarray,
                     lay: dict, receipt: bool = True) -> list[tuple]:
        """Script calls adding/removing ``iids[j]`` to/from bucket ``flat[j]``.

        Entries are sorted by (group, band key), so each call's arguments are
        contiguous slices of three arrays: no Python work per bucket or entry. A
        group's buckets go in segments of at most ``_GROUP_CALL_KEYS``; a call
        takes one segment on a Cluster, and on a single server segments until it
        holds ``_CALL_BUCKETS`` buckets (bounding how long it blocks the server).
        Additions on a layout-4 index carry a receipt unless ``receipt`` is False
        (for a script that is safe to replay as a whole).
        """
        if flat.shape[0] == 0:
            return []
        per_call = 1 if self._is_cluster else _CALL_BUCKETS
        kb = flat.shape[1]
        groups = _groups_of(flat, lay["groups"])
        order = np.lexsort((*_key_words(flat).T[::-1], groups))
        g, keys = groups[order], flat[order]
        new = np.ones(len(order), dtype=bool)  # first entry of each distinct (group, key)
        new[1:] = (g[1:] != g[:-1]) | np.any(keys[1:] != keys[:-1], axis=1)
        first = np.append(np.flatnonzero(new), len(order))
        counts = np.diff(first).astype(_U4)
        ukeys, ug = keys[first[:-1]], g[first[:-1]]
        ids = iids[order].astype(_U4)
        # segments: a group's run of buckets, cut every _GROUP_CALL_KEYS
        starts = np.flatnonzero(np.r_[True, ug[1:] != ug[:-1]])
        run = np.diff(np.append(starts, len(ug)))
        pieces = -(-run // _GROUP_CALL_KEYS)
        seg_lo = np.repeat(starts, pieces) + _GROUP_CALL_KEYS * (
            np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces))
        seg_hi = np.minimum(seg_lo + _GROUP_CALL_KEYS, np.repeat(starts + run, pieces))
        seg_group = ug[seg_lo]
        # calls: whole segments until a call holds per_call buckets (at least one segment)
        held = np.cumsum(seg_hi - seg_lo)
        gkeys = self._group_keys(lay)
        badd = script == "badd"
        cmds = []
        a = 0
        while a < len(seg_lo):
            base = held[a - 1] if a else 0
            b = max(a + 1, int(np.searchsorted(held, base + per_call, side="left")) + 1)
            b = min(b, len(seg_lo))
            lo, hi = int(seg_lo[a]), int(seg_hi[b - 1])
            keys = [gkeys[t] for t in seg_group[a:b].tolist()]
            args = [kb, (seg_hi[a:b] - seg_lo[a:b]).astype(_U4).tobytes(),
                    ukeys[lo:hi].tobytes(), counts[lo:hi].tobytes(),
                    ids[first[lo]:first[hi]].tobytes()]
            if badd:
                args += [lay["spill"], self._receipt_ttl if receipt else 0]
                if lay["spill"] and receipt:
                    keys.append(self._receipt_prefix + os.urandom(12).hex().encode())
            cmds.append(self._eval(script, keys, args))
            a = b
        return cmds

    @_unavailable
    def delete(self, ids: Sequence[str], band_keys_of: BandKeysFn) -> int:
        """Remove these external ids everywhere; returns how many existed.

        Each id disappears atomically (id map, blobs and count in one script);
        its bucket entries are journaled and removed right after.
        """
        uniq = list(dict.fromkeys(ids))
        if not uniq:
            return 0
        lay = self._get_layout(create=False)
        if lay is None:
            return 0
        if len(uniq) == 1 and not self._is_cluster:
            done = self._delete_one(uniq[0], band_keys_of, lay)
            if done is not None:
                return done
        S = lay["shards"]
        expected = dict(zip(uniq, self.lookup(uniq).tolist(), strict=True))
        todo: dict[int, list[str]] = defaultdict(list)
        for e in uniq:
            todo[_shard_of(e, S)].append(e)
        # Shards where nothing exists still run (cheaply): they cancel crashed attempts.
        removed = 0
        dead: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
        ret_flag, ret_keys = self._retire_counting(lay)
        for _round in range(32):
            cmds, order = [], []
            for s, es in todo.items():
                ids_k, pend_k, gc_k, n_k, _ = self._shard_keys(s)
                ckeys = self._chunk_keys([expected[e] for e in es], lay, s)
                args: list[Any] = [S, lay["chunk_big"], lay["chunk_small"], self._tag(s), ret_flag]
                for e in es:
                    args += [e.encode(), expected[e]]
                cmds.append(self._eval("delete", [ids_k, pend_k, gc_k, n_k, *ret_keys, *ckeys], args))
                order.append(s)
            retry: dict[int, list[str]] = {}
            for s, (status, info, dl) in zip(order, self._pipeline(cmds), strict=True):
                dead[s] += _pairs(dl)
                for e, st, cur in zip(todo[s], status, info, strict=True):
                    if st == 1:
                        removed += 1
                    elif st == 3:
                        expected[e] = int(cur)
                        retry.setdefault(s, []).append(e)
            if not retry:
                break
            todo = retry
        else:
            raise StoreError(f"Redis index {self.prefix!r}: ids kept changing under this delete")
        self._bury(dead, band_keys_of, lay)
        return removed

    def _delete_one(self, ext: str, band_keys_of: BandKeysFn, lay: dict) -> int | None:
        """One id on a single server in two round trips (its iid and sketch; then record,
        bucket entries and journal in one script). None: take the general path (the id is
        absent — crashed attempts still need cancelling — or changed in between)."""
        S = lay["shards"]
        s = _shard_of(ext, S)
        ids_k, pend_k, gc_k, n_k, _ = self._shard_keys(s)
        head = [S, lay["chunk_big"], lay["chunk_small"], self._tag(s)]
        iid, sk = self._pipeline([self._eval("look1", [ids_k], [*head, "0", ext.encode()])])[0]
        if iid < 0 or sk is None:
            return None
        keys = np.asarray(band_keys_of(np.frombuffer(sk, dtype=np.uint8)[None]))[0]
        calls = self._bucket_cmds("brem", np.ascontiguousarray(keys, dtype=np.uint8),
                                  np.full(len(keys), iid, dtype=np.int64), lay)
        if len(calls) != 1:
            return None
        bk, ba = _eval_parts(calls[0])
        ret_flag, _ = self._retire_counting(lay)
        status, _, dl = self._pipeline([self._eval(
            "del1", [ids_k, pend_k, gc_k, n_k, self._retires_key, *bk],
            [*head, ret_flag, ext.encode(), iid, len(bk), *ba])])[0]
        if status != 1:
            return None
        self._bury({s: _pairs(dl)}, band_keys_of, lay)
        return 1

    @_unavailable
    def collect_garbage(self, band_keys_of: BandKeysFn, pending_older_than: float = 600.0) -> dict:
        """Clean up after writers that crashed and never retried: maintenance, not hot path.

        Write attempts journaled more than ``pending_older_than`` seconds ago are
        cancelled, and every journaled dead iid loses its bucket entries. Safe to
        run at any time, from any process, concurrently with writers (a writer
        whose attempt was cancelled sees it at commit and drops that record).
        """
        lay = self._get_layout(create=False)
        if lay is None:
            return {"expired_attempts": 0, "dead_iids": 0}
        cmds = []
        for s in range(lay["shards"]):
            _, pend_k, gc_k, _, _ = self._shard_keys(s)
            cmds.append(self._eval("expire", [pend_k, gc_k], [int(pending_older_than)]))
        expired = sum(int(x) for x in self._pipeline(cmds))
        gcs = self._pipeline([("HGETALL", self._shard_keys(s)[2]) for s in range(lay["shards"])])
        dead = {s: [(int(k), v) for k, v in g.items()] for s, g in enumerate(gcs) if g}
        self._bury(dead, band_keys_of, lay)
        return {"expired_attempts": expired, "dead_iids": sum(len(v) for v in dead.values())}

    # --- reads --------------------------------------------------------------------------------
    @_unavailable
    def lookup(self, ids: Sequence[str]) -> np.ndarray:
        """Internal ids (int64) of these external ids; -1 where unknown. One round trip."""
        out = np.full(len(ids), -1, dtype=np.int64)
        if not len(ids):
            return out
        lay = self._get_layout(create=False)
        if lay is None:
            return out
        S = lay["shards"]
        by_shard: dict[int, list[int]] = defaultdict(list)
        for p, e in enumerate(ids):
            by_shard[_shard_of(e, S)].append(p)
        cmds = [("HMGET", self._shard_keys(s)[0], *[ids[p].encode() for p in ps])
                for s, ps in by_shard.items()]
        for ps, vals in zip(by_shard.values(), self._pipeline(cmds), strict=True):
            for p, v in zip(ps, vals, strict=True):
                if v is not None:
                    out[p] = int(v)
        return out

    def _get_blobs(self, iids: np.ndarray, fam: str) -> list[bytes | None]:
        """Blobs of family ``fam`` for these iids: one HMGET per chunk key, one round trip."""
        (out,), reads, fill = self._blob_reads(iids, (fam,))
        fill(self._pipeline([("HMGET", key, *fields) for key, fields in reads]))
        return out

    def _blob_reads(self, iids: np.ndarray, fams: Sequence[str]):
        """(outputs, reads, fill): ``reads`` lists (chunk key, fields), one per chunk key
        holding any of these iids' blobs in ``fams``; ``fill(values)`` takes each read's
        values, in order, into the outputs (one list per family, None until then)."""
        a = np.asarray(iids).ravel().astype(np.int64, copy=False)
        outs: list[list[bytes | None]] = [[None] * a.size for _ in fams]
        lay = self._get_layout(create=False) if a.size else None
        reads: list[tuple[str, list[int]]] = []
        plan: list[tuple[list, list[int]]] = []  # per read: (output list, positions in it)
        if lay is not None and a.size <= _SMALL_READ:
            self._group_small(a.tolist(), outs, fams, lay, reads, plan)
        elif lay is not None:
            self._group_large(a, outs, fams, lay, reads, plan)

        def fill(values: list) -> None:
            for (out, pos), vals in zip(plan, values, strict=True):
                for p, v in zip(pos, vals, strict=True):
                    out[p] = v

        return outs, reads, fill

    def _group_small(self, iids: list[int], outs: list[list], fams: Sequence[str], lay: dict,
                     reads: list, plan: list) -> None:
        """:meth:`_blob_reads`' grouping for a query's answer: a few iids, plain Python
        (numpy's per-call overhead is most of the time at this size)."""
        S = lay["shards"]
        for out, fam in zip(outs, fams, strict=True):
            C = self._chunk(fam, lay)
            by_key: dict[str, tuple[list[int], list[int]]] = {}
            for p, iid in enumerate(iids):
                if 0 <= iid < _IID_LIMIT:
                    seq, s = divmod(iid, S)
                    fields, pos = by_key.setdefault(f"{self._tag(s)}{fam}:{seq // C}", ([], []))
                    fields.append(seq % C)
                    pos.append(p)
            for key, (fields, pos) in by_key.items():
                reads.append((key, fields))
                plan.append((out, pos))

    def _group_large(self, a: np.ndarray, outs: list[list], fams: Sequence[str], lay: dict,
                     reads: list, plan: list) -> None:
        """:meth:`_blob_reads`' grouping for many iids, vectorised: sort by chunk key."""
        valid = np.flatnonzero((a >= 0) & (a < _IID_LIMIT))
        if not valid.size:
            return
        for out, fam in zip(outs, fams, strict=True):
            s, c, f = self._locs(a[valid], fam, lay)
            kid = s * (1 << 32) + c  # one id per chunk key
            order = np.argsort(kid, kind="stable")
            kid_sorted = kid[order]
            cuts = (np.flatnonzero(np.diff(kid_sorted)) + 1).tolist()
            f_sorted = f[order].tolist()
            pos = valid[order].tolist()
            for lo, hi in zip([0, *cuts], [*cuts, len(order)], strict=True):
                k = int(kid_sorted[lo])
                reads.append((f"{self._tag(k >> 32)}{fam}:{k & 0xFFFFFFFF}", f_sorted[lo:hi]))
                plan.append((out, pos[lo:hi]))

    def _answer_reads(self, iids: np.ndarray, fams: Sequence[str], counters: Sequence[bytes]
                      ) -> tuple[list[list[bytes | None]], list[int]]:
        """Blobs of a few iids in ``fams``, and the values of the ``counters``: one round trip.

        On a single server, one script call; on a Cluster (keys in many slots), one
        pipeline of HMGETs and GETs.
        """
        outs, reads, fill = self._blob_reads(iids, fams)
        if not reads and not counters:  # nothing to read: no round trip
            return outs, []
        if self._is_cluster:
            replies = self._pipeline([("HMGET", key, *fields) for key, fields in reads]
                                     + [("GET", k) for k in counters])
            fill(replies[: len(reads)])
            return outs, [int(v or 0) for v in replies[len(reads):]]
        args: list[Any] = [len(reads), *[len(fields) for _, fields in reads]]
        for _, fields in reads:
            args += fields
        flat, values_c = self._pipeline([self._eval("reads", [key for key, _ in reads] + list(counters),
                                                    args)])[0]
        values, o = [], 0
        for _, fields in reads:
            values.append(flat[o: o + len(fields)])
            o += len(fields)
        fill(values)
        return outs, [int(v or 0) for v in values_c]

    @_unavailable
    def ids_fetch_and_news(self, iids: np.ndarray, field: str, token: object
                           ) -> tuple[list[str | None], list[bytes | None], bool, int | None]:
        """:meth:`ids_and_fetch`, whether any shard sequence moved past ``token``, and the
        retirement count (layout ≥ 3; None before): one round trip.

        Sequences only grow, so one moved past the token exactly when their sum did;
        on a single server that sum is one key, ``allocs``.
        """
        lay = self._get_layout(create=False)
        if lay is None:
            return [None] * len(iids), [None] * len(iids), False, None
        S = lay["shards"]
        if lay["allocs"]:
            counters = [self._allocs_key, self._retires_key] if lay["retires"] else [self._allocs_key]
        else:
            counters = self._seq_keys(S)
        (names, blobs), values = self._answer_reads(iids, ("x", self._family(field)), counters)
        if lay["retires"]:
            allocs, epoch = values
        else:
            allocs, epoch = sum(values), None
        return decode_names(names), blobs, allocs > sum(self._token_seqs(token, S)), epoch

    @_unavailable
    def news_and_epoch(self, token: object) -> tuple[bool, int | None]:
        """Whether any iid was allocated since ``token``, and the retirement count: one
        ``MGET`` of two counters (layout ≥ 3). Without that count (a Cluster, an older
        layout): (True, None), so the caller falls back to :meth:`ids_fetch_and_news`."""
        lay = self._get_layout(create=False)
        if lay is None or not lay["retires"]:
            return True, None
        allocs, retires = self._pipeline([("MGET", self._allocs_key, self._retires_key)])[0]
        return int(allocs or 0) > sum(self._token_seqs(token, lay["shards"])), int(retires or 0)

    @_unavailable
    def external_ids(self, iids: np.ndarray) -> list[str | None]:
        """External ids of these internal ids; None where the iid is gone (or not yet live)."""
        return decode_names(self._get_blobs(iids, "x"))

    @_unavailable
    def fetch(self, iids: np.ndarray, field: str) -> list[bytes | None]:
        """Blob ``field`` of each iid, in order; None where absent. One round trip."""
        return self._get_blobs(iids, self._family(field))

    @_unavailable
    def ids_and_fetch(self, iids: np.ndarray, field: str) -> tuple[list[str | None], list[bytes | None]]:
        """:meth:`external_ids` and :meth:`fetch` together, in one round trip."""
        (names, blobs), _ = self._answer_reads(iids, ("x", self._family(field)), ())
        return decode_names(names), blobs

    @staticmethod
    def _family(field: str) -> str:
        fam = _FAMILY.get(field)
        if fam is None:
            raise ValueError(f"field: unknown blob field {field!r}; one of {FIELDS}")
        return fam

    @_unavailable
    def bucket_members(self, keys: Sequence[bytes] | np.ndarray) -> np.ndarray:
        """Members (uint32) of all these buckets concatenated, one entry per bucket hit.

        One pipelined round trip of GETs; each bucket is already packed uint32, so
        the answer is one ``np.frombuffer`` with no Python work per member.
        """
        arrays = _as_key_array(keys)
        if not arrays:
            return np.empty(0, dtype=np.uint32)
        lay = self._get_layout(create=False)
        if lay is None:
            return np.empty(0, dtype=np.uint32)
        by_group: dict[int, list[bytes]] = defaultdict(list)
        for a in arrays:
            for t, field in zip(_groups_of(a, lay["groups"]).tolist(), _rows(a), strict=True):
                by_group[t].append(field)
        if self._is_cluster:  # no spilled buckets on a Cluster (no receipts there)
            cmds = [("HMGET", self._group_key(t), *fs) for t, fs in by_group.items()]
            buf = b"".join(v for vals in self._pipeline(cmds) for v in vals if v)
        else:
            groups = list(by_group.items())
            keys = [self._group_key(t) for t, _ in groups]
            args = [len(fs) for _, fs in groups] + [f for _, fs in groups for f in fs]
            buf = self._pipeline([self._eval("bget", keys, args)])[0] or b""
        return np.frombuffer(buf, dtype=_U4).astype(np.uint32)

    @_unavailable
    def scan(self, field: str, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, list[bytes]]]:
        """Every live record holding ``field``, in iid order, as (iids int64, blobs) chunks.

        Not a snapshot: a record committed or removed during the scan may or may
        not appear, but every blob yielded is a complete, committed one.
        """
        fam = _FAMILY.get(field)
        if fam is None:
            raise ValueError(f"field: unknown blob field {field!r}; one of {FIELDS}")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be ≥ 1, got {batch_size}")
        return self._scan(fam, batch_size)

    def _scan(self, fam: str, batch_size: int) -> Iterator[tuple[np.ndarray, list[bytes]]]:
        try:
            lay = self._get_layout(create=False)
            if lay is None:
                return
            S = lay["shards"]
            C = self._chunk(fam, lay)
            # Window of seqs read per round: all shards × W seqs ≈ batch_size records.
            W = 1
            while W * 2 <= min(C, max(1, batch_size // S)):
                W *= 2
            seqs = self._pipeline([("GET", self._shard_keys(s)[4]) for s in range(S)])
            top = max(int(x or 0) for x in seqs)
            iids_buf: list[int] = []
            blobs_buf: list[bytes] = []
            for a in range(0, top, W):
                c, off = divmod(a, C)
                fields = list(range(off, off + W))
                vals = self._pipeline([("HMGET", f"{self._tag(s)}{fam}:{c}", *fields)
                                       for s in range(S)])
                for j in range(W):
                    for s in range(S):
                        v = vals[s][j]
                        if v is not None:
                            iids_buf.append((a + j) * S + s)
                            blobs_buf.append(v)
                while len(iids_buf) >= batch_size:
                    yield (np.array(iids_buf[:batch_size], dtype=np.int64),
                           blobs_buf[:batch_size])
                    del iids_buf[:batch_size], blobs_buf[:batch_size]
            if iids_buf:
                yield np.array(iids_buf, dtype=np.int64), blobs_buf
        except (*_UNAVAILABLE, ResponseError) as e:
            raise self._translate(e) from None

    @_unavailable
    def scan_buckets(self) -> Iterator[tuple[bytes, np.ndarray]]:
        """Every bucket as (band key, member iids uint32), via SCAN (every master of a Cluster)."""
        return self._scan_buckets()

    def _scan_buckets(self, chunk: int = 16) -> Iterator[tuple[bytes, np.ndarray]]:
        try:
            it = self._r().scan_iter(match=self._bucket_prefix + b"*", count=1000)
            while True:
                names = [n for _, n in zip(range(chunk), it, strict=False)]
                if not names:
                    return
                groups = self._pipeline([("HGETALL", n) for n in names])
                big = [(n, k) for n, g in zip(names, groups, strict=True)
                       for k, v in g.items() if v == b""]
                spilled = dict(zip(big, self._pipeline([("GET", self._spill_key(n, k))
                                                        for n, k in big]), strict=True))
                for n, group in zip(names, groups, strict=True):
                    for band_key, v in group.items():
                        if v == b"":
                            v = spilled[n, band_key] or b""
                        if v:
                            yield band_key, np.frombuffer(v, dtype=_U4).astype(np.uint32)
        except (*_UNAVAILABLE, ResponseError) as e:
            raise self._translate(e) from None

    @_unavailable
    def count(self) -> int:
        """Number of live vectors (exact: per-shard counters kept by the commit scripts)."""
        lay = self._get_layout(create=False)
        if lay is None:
            return 0
        vals = self._pipeline([("GET", self._shard_keys(s)[3]) for s in range(lay["shards"])])
        return sum(int(v or 0) for v in vals)

    @_unavailable
    def iid_bound(self) -> int:
        """An exclusive upper bound on every live iid: (largest shard sequence) · shards."""
        lay = self._get_layout(create=False)
        if lay is None:
            return 0
        S = lay["shards"]
        return max(self._shard_seqs(S)) * S

    def _shard_seqs(self, S: int) -> list[int]:
        """Every shard's iid sequence: one MGET on a single server, a pipeline on a Cluster."""
        keys = self._seq_keys(S)
        if self._is_cluster:  # keys in different slots: one GET each
            replies = self._pipeline([("GET", k) for k in keys])
        else:
            replies = self._pipeline([("MGET", *keys)])[0]
        return [int(v or 0) for v in replies]

    def _seq_keys(self, S: int) -> list[bytes]:
        """Every shard's sequence key (built once, encoded: a query names all of them)."""
        if len(self._seq_key_list) != S:
            self._seq_key_list = [self._shard_keys(s)[4].encode() for s in range(S)]
        return self._seq_key_list

    @staticmethod
    def _token_seqs(token: object | None, S: int) -> list[int]:
        """The shard sequences an :meth:`allocated_since` token holds (None: the start)."""
        return list(token) if token is not None else [0] * S

    @_unavailable
    def allocated_since(self, token: object | None) -> tuple[np.ndarray, object]:
        """iids allocated since ``token`` (the shard sequences then), in one round trip.

        Shards allocate independently (``iid = seq · shards + shard``), so new iids
        can lie below ones seen before: the token keeps every shard's sequence.
        """
        lay = self._get_layout(create=False)
        if lay is None:
            return np.empty(0, dtype=np.int64), token
        S = lay["shards"]
        seqs = self._shard_seqs(S)
        old = self._token_seqs(token, S)
        parts = [np.arange(old[s], seqs[s], dtype=np.int64) * S + s for s in range(S) if seqs[s] > old[s]]
        new = np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)
        return new, tuple(max(a, b) for a, b in zip(old, seqs, strict=True))

    # --- housekeeping --------------------------------------------------------------------------
    @_unavailable
    def ping(self) -> None:
        """Raise :class:`StoreUnavailable` if Redis (every master of a Cluster) cannot be reached."""
        r = self._r()
        if self._is_cluster:
            r.ping(target_nodes=redis.RedisCluster.PRIMARIES)
        else:
            r.ping()

    @_unavailable
    def info(self) -> dict:
        """Backend facts for /stats: kind, masked URL, prefix, server memory, vector count."""
        r = self._r()
        if self._is_cluster:
            mem = r.info("memory", target_nodes=redis.RedisCluster.PRIMARIES)
            used = sum(int(v.get("used_memory", 0)) for v in mem.values()
                       if isinstance(v, dict))
        else:
            used = int(r.info("memory").get("used_memory", 0))
        lay = self._get_layout(create=False) or self._new_layout
        return {
            "kind": "redis",
            "url": mask_url(self.url),
            "prefix": self.prefix,
            "cluster": self._is_cluster,
            "used_memory": used,
            "vectors": self.count(),
            "shards": lay["shards"],
            "bucket_groups": lay["groups"],
            "spill_bytes": lay["spill"],
        }

    def close(self) -> None:
        """Drop the connections (idempotent); later calls raise :class:`StoreUnavailable`."""
        with self._lock:
            client, self._client = self._client, None
            self._closed = True
        if client is not None:
            try:
                client.close()
            except RedisError:
                pass

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisStore({mask_url(self.url)!r}, prefix={self.prefix!r})"


def _sha1(text: str) -> str:
    import hashlib

    return hashlib.sha1(text.encode()).hexdigest()
