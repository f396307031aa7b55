-- prune_workers.lua (script; loaded by tasks/lease.py)
-- Drop from the registry the workers whose lease is gone, each only if it is still gone (a worker
-- that takes its lease again in between stays). KEYS[1] registry, KEYS[2..] their leases; ARGV their
-- names. Returns how many were dropped.
local dropped = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    dropped = dropped + redis.call('SREM', KEYS[1], ARGV[i - 1])
  end
end
return dropped
