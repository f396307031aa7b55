-- cancel_queued.lua (script; loaded by tasks/store.py)
-- Withdraw a task that no worker runs, by its entry id (the task's lookup hash records it): delete
-- the entry unless a worker holds it (a running task's worker is told to stop instead); a re-queued
-- entry, which waits, is acknowledged and deleted. KEYS[1] queue; ARGV group, entry id, the REQUEUED
-- consumer's name. Returns {status, entry id, attempt}: 2 removed; 1 delivered (running, left
-- alone); 0 no such entry (finished, or never queued here).
local rows = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if #rows == 0 then return {0, '', 0} end
local attempt = 1
local flat = rows[1][2]
for i = 1, #flat, 2 do if flat[i] == 'attempt' then attempt = tonumber(flat[i + 1]) end end
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if type(p) == 'table' and p.err == nil and #p > 0 then
  if p[1][2] ~= ARGV[3] then return {1, ARGV[2], tonumber(p[1][4])} end
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  attempt = tonumber(p[1][4]) + 1
end
redis.call('XDEL', KEYS[1], ARGV[2])
return {2, ARGV[2], attempt}
