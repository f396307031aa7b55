-- hand_back.lua (script; loaded by tasks/store.py)
-- Move a handed-off task (router.handoff) its worker has not taken from its pinned stream to the
-- shared queue it would have joined, at once: the entry leaves the pinned stream only if nobody
-- has taken it, and the task's lookup hash follows it. KEYS[1] the pinned stream, KEYS[2] the task
-- hash, KEYS[3] the shared queue, KEYS[4] registry of queues; ARGV[1] group, ARGV[2] entry id.
-- Returns the new entry id, or '' (taken meanwhile, or gone).
local last = last_delivered(KEYS[1], ARGV[1])
if last == nil then return '' end
local ems, eseq = key(ARGV[2])
local lms, lseq = key(last)
if ems == nil or (ems < lms or (ems == lms and eseq <= lseq)) then return '' end
local rows = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if #rows == 0 then return '' end
local failed = ensure_group(KEYS[3], ARGV[1])
if failed then return redis.error_reply(failed) end
local id = redis.call('XADD', KEYS[3], '*', unpack(rows[1][2]))
redis.call('XDEL', KEYS[1], ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('HSET', KEYS[2], 'entry', id, 'queue', KEYS[3]) end
redis.call('SADD', KEYS[4], KEYS[3])
return id
