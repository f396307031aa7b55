-- finish.lua (script; loaded by tasks/store.py)
-- Acknowledge and delete a finished entry (prompts do not outlive their task), only while `owner`
-- holds it: a run that lost its entry (re-queued in place, perhaps taken again) must not remove it.
-- KEYS[1] queue; ARGV group, entry id, owner ('' = whoever holds it). Returns 1 when acknowledged
-- here; 0 when the entry was not pending for the owner any more.
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or (ARGV[3] ~= '' and p[1][2] ~= ARGV[3]) then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
