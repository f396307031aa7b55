-- apply.lua (script; loaded by projections/store.py)
-- The table update and the checkpoint in one step, refused unless the caller still owns the
-- namespace (fencing) and the checkpoint is where the caller last left it: the day shards that fell
-- out of retention are deleted, the changed rows written, the checkpoint moved (its TTL kept) and
-- the folded count recorded.
-- KEYS[1] owner, KEYS[2] checkpoint, KEYS[3] meta, then the `ndrop` day shards that fell out of
-- retention, then the tables (or day shards) that changed.
-- ARGV[1] token, ARGV[2] expected checkpoint ('' for none), ARGV[3] new checkpoint, ARGV[4] folded
-- count, ARGV[5] ndrop, then per changed table its number of fields, then field, value pairs.
-- Returns 1 when applied (store.APPLIED), 0 when the caller no longer owns the namespace
-- (NOT_OWNER), -1 when the checkpoint moved since the caller read it (MOVED).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local cp = redis.call('GET', KEYS[2]) or ''
if cp ~= ARGV[2] then return -1 end
local ndrop = tonumber(ARGV[5])
for i = 4, 3 + ndrop do
  redis.call('DEL', KEYS[i])
end
local pos = 6
for i = 4 + ndrop, #KEYS do
  local n = tonumber(ARGV[pos])
  pos = pos + 1
  for j = 1, n do
    redis.call('HSET', KEYS[i], ARGV[pos], ARGV[pos + 1])
    pos = pos + 2
  end
end
redis.call('SET', KEYS[2], ARGV[3], 'KEEPTTL')
redis.call('HSET', KEYS[3], 'folded', ARGV[4])
return 1
