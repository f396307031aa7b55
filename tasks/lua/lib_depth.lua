-- lib_depth.lua (shared functions)
-- How many entries one model's queues hold, all its bands together (queued, and delivered ones not
-- yet finished): `plain` its plain queue, `bands` its zset of bands.
local function depth(plain, bands)
  local n = 0
  if redis.call('TYPE', plain).ok == 'stream' then n = redis.call('XLEN', plain) end
  for _, q in ipairs(redis.call('ZRANGE', bands, 0, -1)) do
    if q ~= plain and redis.call('TYPE', q).ok == 'stream' then n = n + redis.call('XLEN', q) end
  end
  return n
end
