-- requeue.lua (script; loaded by tasks/store.py)
-- Put a delivered entry back in its queue, in its place: it is handed, still pending, to the
-- REQUEUED consumer, whose entries a worker takes before any undelivered one (TaskStore.take). The
-- entry never moves, so a re-queued task stays ahead of newer work, and its delivery count records
-- the attempts spent. A re-sent call (its reply was lost) finds its own work done and says so again,
-- so that the caller still records it.
-- KEYS[1] queue; ARGV group, entry id, owner ('' = any), min idle ms ('' = no check), delivery limit,
-- bump ('1': a delivery was spent; '0': handed back unrun), the attempt the caller ran ('' = unknown),
-- the REQUEUED consumer's name.
-- Returns {status, entry id or '', next attempt, task id}: status 1 re-queued; 0 not pending for that
-- owner (or not idle enough: its owner came back); -1 the entry vanished (acknowledged here);
-- 2 past the delivery limit: nothing moved, the caller dead-letters it first and then finishes it.
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 then return {0, '', 0, ''} end
local holder, idle, count = p[1][2], tonumber(p[1][3]), tonumber(p[1][4])
local rows = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
local id = ''
if #rows > 0 then
  local flat = rows[1][2]
  for i = 1, #flat, 2 do if flat[i] == 'id' then id = flat[i + 1] end end
end
if ARGV[3] ~= '' and holder ~= ARGV[3] then
  if ARGV[7] ~= '' then
    local ran = tonumber(ARGV[7])
    if (holder == ARGV[8] and count >= ran - 1 and count <= ran) or count > ran then
      return {1, ARGV[2], count + 1, id}
    end
  end
  return {0, '', 0, ''}
end
if ARGV[4] ~= '' and idle < tonumber(ARGV[4]) then return {0, '', 0, ''} end
if #rows == 0 then
  -- pcall: a worker's ACL has no XACK; the reaper acknowledges the empty entry then.
  redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
  return {-1, '', 0, ''}
end
local spent = count
if ARGV[6] == '1' then
  if count + 1 > tonumber(ARGV[5]) then return {2, '', count, id} end
else
  spent = count - 1
end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[8], 0, ARGV[2], 'RETRYCOUNT', spent, 'JUSTID')
return {1, ARGV[2], spent + 1, id}
