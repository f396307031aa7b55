-- renew_lease.lua (script; loaded by events/singleton.py, and by projections/projector.py for its fenced lease)
-- Compare-and-renew of a singleton lease: only its holder's token may extend it, so that a holder
-- that paused past its TTL cannot take back a lease another instance holds now.
-- KEYS[1] the lease key; ARGV[1] the holder's token, ARGV[2] the new TTL in ms.
-- Returns 1 renewed, 0 the key is gone or another holder's.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
