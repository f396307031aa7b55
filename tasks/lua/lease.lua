-- lease.lua (script; loaded by tasks/lease.py)
-- Take or renew a worker's lease, refusing a twin: the lease is written only when it is absent or
-- holds this process's token; a worker that takes a lease (anew, or after it lapsed) joins the
-- registry of workers. A renewal is a GET and a SET, nothing more (it runs every heartbeat of every
-- worker). KEYS[1] lease, KEYS[2] registry; ARGV token, value, ttl ms, worker name.
-- Returns {1, 1 when there was no lease (a first take, or it had lapsed) else 0} or {0, holder's token}.
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, info = pcall(cmsgpack.unpack, cur)
  if ok and type(info) == 'table' and info['token'] ~= nil and info['token'] ~= ARGV[1] then
    return {0, info['token']}
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if cur then return {1, 0} end
redis.call('SADD', KEYS[2], ARGV[4])
return {1, 1}
