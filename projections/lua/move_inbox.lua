-- move_inbox.lua (script; loaded by projections/ingest.py)
-- Move one inbox's checked entries: each is deleted from the inbox and, only if this call deleted
-- it (so that no entry is moved twice), appended to the ledger or, refused, to the dead letters; an
-- accepted entry that closes a run then finishes the run's queue entries (acknowledged and deleted)
-- that the worker still holds. Then the claims and grades the batch changed are written, and the
-- worker joins the set of workers that ran each task it claimed (Keys.ran: the API serves output
-- only from those).
-- KEYS[1] ledger, KEYS[2] inbox, KEYS[3] dead letters, KEYS[4] claims, KEYS[5] graded, KEYS[6...]
-- the task queues the batch finishes entries of and the `ran` sets of the tasks it claimed.
-- ARGV[1] dead letters' cap, ARGV[2] worker, ARGV[3] consumer group, ARGV[4] n; n times: inbox id,
-- reason ('' = accepted), type, v, data, f, then f pairs (index of a queue in KEYS, entry id);
-- then m and m pairs (task, claims value or '' to delete); then r, the ttl ms of a `ran` set, and r
-- indexes of `ran` sets in KEYS; then grade members.
-- Returns {entries moved into the ledger, queue entries finished}.
local n = tonumber(ARGV[4])
local i = 5
local moved, finished = 0, 0
for _ = 1, n do
  local id, reason = ARGV[i], ARGV[i + 1]
  local f = tonumber(ARGV[i + 5])
  if redis.call('XDEL', KEYS[2], id) == 1 then
    if reason == '' then
      redis.call('XADD', KEYS[1], '*', 'type', ARGV[i + 2], 'v', ARGV[i + 3], 'data', ARGV[i + 4])
      moved = moved + 1
      for j = 1, f do
        local q, e = KEYS[tonumber(ARGV[i + 4 + 2 * j])], ARGV[i + 5 + 2 * j]
        local p = redis.pcall('XPENDING', q, ARGV[3], e, e, 1)
        if type(p) == 'table' and p.err == nil and #p > 0 and p[1][2] == ARGV[2] then
          redis.call('XACK', q, ARGV[3], e)
          redis.call('XDEL', q, e)
          finished = finished + 1
        end
      end
    else
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[1], '*', 'source', 'inbox', 'worker', ARGV[2],
        'entry_id', id, 'type', ARGV[i + 2], 'reason', reason)
    end
  end
  i = i + 6 + 2 * f
end
local m = tonumber(ARGV[i])
i = i + 1
for _ = 1, m do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[4], ARGV[i])
  else
    redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1])
  end
  i = i + 2
end
local r = tonumber(ARGV[i])
local ttl = ARGV[i + 1]
i = i + 2
for _ = 1, r do
  local ran = KEYS[tonumber(ARGV[i])]
  redis.call('SADD', ran, ARGV[2])
  redis.call('PEXPIRE', ran, ttl)
  i = i + 1
end
for j = i, #ARGV do redis.call('SADD', KEYS[5], ARGV[j]) end
return {moved, finished}
