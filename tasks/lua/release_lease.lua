-- release_lease.lua (script; loaded by tasks/lease.py)
-- Give a lease up on the way out, only if it is still this process's. KEYS[1] lease, KEYS[2]
-- registry; ARGV token, worker name. Returns 1 if it was released.
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, info = pcall(cmsgpack.unpack, cur)
  if ok and type(info) == 'table' and info['token'] ~= ARGV[1] then return 0 end
  redis.call('DEL', KEYS[1])
end
redis.call('SREM', KEYS[2], ARGV[2])
return 1
