-- take_given.lua (script; loaded by tasks/store.py)
-- Take a queued entry that is not the head (the size-aware gate gave this worker a later task): the
-- consumer group hands out only the next undelivered entry, so the entry moves to the worker's
-- pinned stream and is delivered there at once, in one step. Only while it is still undelivered on
-- the shared queue (after the group's last delivered id), or waits there re-queued (it moves as its
-- next attempt, as _HAND_BACK_REQUEUED moves one), and is the task named; and only when the
-- pinned stream has nothing for the worker (no undelivered or re-queued entry): that work comes
-- first. The task's lookup hash follows the entry (a cancel finds it) and names the shared queue as
-- its `fallback`, so that, as a hand-off, the reaper moves it back there if the worker dies holding
-- it or gives it back. KEYS[1] the shared queue, KEYS[2] the worker's pinned stream, KEYS[3] the task
-- hash, KEYS[4] registry of queues; ARGV[1] group, ARGV[2] consumer, ARGV[3] entry id, ARGV[4] task
-- id, ARGV[5] the REQUEUED consumer's name.
-- Returns what _TAKE returns: {entry id on the pinned stream, attempt, fields, ''}, or {'', 0, {},
-- cursor of the shared queue} when nothing was taken.
local function nothing()
  local tail = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  if #tail == 0 then return {'', 0, {}, '0-0'} end
  return {'', 0, {}, tail[1][1]}
end
local last = last_delivered(KEYS[1], ARGV[1])
if last == nil then return nothing() end
local ems, eseq = key(ARGV[3])
local lms, lseq = key(last)
if ems == nil then return nothing() end
-- Delivered: taken only when it waits re-queued (held by the REQUEUED consumer), as its next attempt.
local held = nil
if ems < lms or (ems == lms and eseq <= lseq) then
  held = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[5])
  if #held == 0 then return nothing() end
end
local rows = redis.call('XRANGE', KEYS[1], ARGV[3], ARGV[3])
if #rows == 0 then return nothing() end
local given = rows[1][2]
local ident, attempt = '', 1
for i = 1, #given, 2 do
  local f, v = given[i], given[i + 1]
  if f == 'id' then ident = v elseif f == 'attempt' then attempt = tonumber(v) end
end
if ident ~= ARGV[4] then return nothing() end
if held ~= nil then attempt = tonumber(held[1][4]) + 1 end
local flat = {}
for i = 1, #given, 2 do
  flat[#flat + 1] = given[i]
  if given[i] == 'attempt' then flat[#flat + 1] = tostring(attempt) else flat[#flat + 1] = given[i + 1] end
end
local failed = ensure_group(KEYS[2], ARGV[1])
if failed then return redis.error_reply(failed) end
local mine = last_delivered(KEYS[2], ARGV[1])
if #redis.call('XRANGE', KEYS[2], '(' .. mine, '+', 'COUNT', 1) > 0 then return nothing() end
if #redis.call('XPENDING', KEYS[2], ARGV[1], '-', '+', 1, ARGV[5]) > 0 then return nothing() end
local id = redis.call('XADD', KEYS[2], '*', unpack(flat))
if held ~= nil then redis.call('XACK', KEYS[1], ARGV[1], ARGV[3]) end
redis.call('XDEL', KEYS[1], ARGV[3])
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HSET', KEYS[3], 'entry', id, 'queue', KEYS[2], 'fallback', KEYS[1])
end
redis.call('SADD', KEYS[4], KEYS[2])
local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[2], '>')
local row = got[1][2][1]
if attempt > 1 then
  redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[2], 0, row[1], 'RETRYCOUNT', attempt, 'JUSTID')
end
return {row[1], attempt, row[2], ''}
