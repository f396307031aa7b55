-- hand_back_requeued.lua (script; loaded by tasks/store.py)
-- Move a handed-off task its worker gave back (re-queued in place for ARGV[3], the re-queued
-- consumer: a retryable failure, a shutdown mid-run, or the reaper after its worker died) from the
-- pinned stream to the shared queue, as its next attempt: only while nobody has taken it again.
-- KEYS as _HAND_BACK; ARGV[1] group, ARGV[2] entry id, ARGV[3] the re-queued consumer.
-- Returns the new entry id, or '' (taken again meanwhile, or gone).
local held = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3])
if #held == 0 then return '' end
local rows = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if #rows == 0 then return '' end
local attempt = tostring(tonumber(held[1][4]) + 1)
local fields = {}
local flat = rows[1][2]
for i = 1, #flat, 2 do
  fields[#fields + 1] = flat[i]
  if flat[i] == 'attempt' then fields[#fields + 1] = attempt else fields[#fields + 1] = flat[i + 1] end
end
local failed = ensure_group(KEYS[3], ARGV[1])
if failed then return redis.error_reply(failed) end
local id = redis.call('XADD', KEYS[3], '*', unpack(fields))
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('HSET', KEYS[2], 'entry', id, 'queue', KEYS[3]) end
redis.call('SADD', KEYS[4], KEYS[3])
return id
