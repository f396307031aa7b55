-- submit.lua (script; loaded by tasks/store.py)
-- Submit a task exactly once, keyed by its id: the ledger events, the queue entry and the task's
-- lookup hash (which records the entry, so that a cancel finds it without reading the queue), or
-- nothing if the task exists already (a re-sent submission). The queue and its group are made if
-- missing, and the queue joins the registry of queues.
-- A band queue (events.keys.Keys.band_queue) joins its model's zset of bands too. With a cap, a new
-- task is refused when the model's queues (see depth.lua) hold that many entries already: checked in
-- the same call, so that a submission is one round trip.
-- KEYS[1] ledger, KEYS[2] task hash, KEYS[3] queue, KEYS[4] registry of queues, KEYS[5] the model's
-- bands, KEYS[6] the model's plain queue, KEYS[7] the model's bands (for the cap); ARGV[1] the packed
-- events, ARGV[2] the hash's ttl ms, ARGV[3] group, ARGV[4] n, ARGV[5] the queue's place among its
-- model's bands ('' = not a band queue), ARGV[6] the cap ('' = none), then n hash field/value items,
-- then the queue entry's field/value items. Returns {1, entry id} when queued now, {0, entry id}
-- when it was queued before, {-1, depth} when the model's queues are at the cap.
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {0, redis.call('HGET', KEYS[2], 'entry') or ''}
end
if ARGV[6] ~= '' then
  local held = depth(KEYS[6], KEYS[7])
  if held >= tonumber(ARGV[6]) then return {-1, held} end
end
local made = redis.pcall('XGROUP', 'CREATE', KEYS[3], ARGV[3], '0', 'MKSTREAM')
if type(made) == 'table' and made.err and not string.find(made.err, 'BUSYGROUP') then
  return redis.error_reply(made.err)
end
append_blob(KEYS[1], ARGV[1], nil)
local n = tonumber(ARGV[4])
local info = {}
for i = 7, 6 + n do info[#info + 1] = ARGV[i] end
local fields = {}
for i = 7 + n, #ARGV do fields[#fields + 1] = ARGV[i] end
local entry = redis.call('XADD', KEYS[3], '*', unpack(fields))
redis.call('HSET', KEYS[2], 'entry', entry, unpack(info))
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[4], KEYS[3])
if ARGV[5] ~= '' then redis.call('ZADD', KEYS[5], ARGV[5], KEYS[3]) end
return {1, entry}
