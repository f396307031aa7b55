-- keep.lua (script; loaded by tasks/store.py)
-- Keep a consumer's running entries alive: reset the idle time of each that is still pending for it
-- (XCLAIM JUSTID, which counts no delivery), and only those: a plain XCLAIM would take back an
-- entry that was re-queued in place, or taken by another worker since. KEYS[1] queue; ARGV group,
-- consumer, entry ids. Returns the ids still held.
local held = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    held[#held + 1] = ARGV[i]
  end
end
return held
