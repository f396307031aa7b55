-- adopt.lua (script; loaded by projections/store.py)
-- Take a namespace over for a new owner: the old owner's next write (apply.lua) is refused from
-- here on. KEYS[1] owner, KEYS[2] checkpoint; ARGV[1] the new owner's token.
-- Returns the checkpoint as the previous owner left it (nil when there is none).
redis.call('SET', KEYS[1], ARGV[1])
return redis.call('GET', KEYS[2])
