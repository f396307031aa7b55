-- take_over.lua (script; loaded by tasks/store.py)
-- A later run of a completed task finds a stored result whose writer never marked it `logged` (it
-- died between storing the result and appending TaskCompleted): the first such run takes over the
-- ledger record, so that the completion still counts once. KEYS[1] result hash; ARGV attempt.
-- Returns 1 to the one run that takes over, 0 to every other.
if redis.call('HGET', KEYS[1], 'status') ~= 'completed' then return 0 end
if redis.call('HEXISTS', KEYS[1], 'logged') == 1 then return 0 end
return redis.call('HSETNX', KEYS[1], 'taken', ARGV[1])
