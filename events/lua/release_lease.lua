-- release_lease.lua (script; loaded by events/singleton.py, and by projections/projector.py for its fenced lease)
-- Compare-and-delete of a singleton lease: only its holder's token may give it up, so that a
-- holder that lost its lease never deletes the one another instance took since.
-- KEYS[1] the lease key; ARGV[1] the holder's token.
-- Returns 1 released, 0 the key is gone or another holder's.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
