-- quota_admit.lua (script; loaded by tasks/quota.py)
-- Admit one request for a key, or say which limit refuses it. KEYS[1] the key's usage hash, KEYS[2]
-- its open tasks (zset task id -> admitted at ms); ARGV task id, rpm, tokens per day, max queued
-- (0 = no limit), how long an unsettled task stays open (ms), 1 for a pipeline's child (held to
-- tokens per day and max queued, not to rpm: the pipeline's own request paid the rate). Returns
-- {0, 0, open tasks before this one, ''} when admitted (a re-sent admission of the same task is
-- admitted again, counted once); {1, retry after ms, 0, limit} when refused.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local day = math.floor(now / 86400000)
if tonumber(redis.call('HGET', KEYS[1], 'day') or '-1') ~= day then
  redis.call('HSET', KEYS[1], 'day', day, 'tokens', 0)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[5]))
local open = redis.call('ZCARD', KEYS[2])
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return {0, 0, open - 1, ''} end
local function refuse(limit, wait)
  redis.call('HINCRBY', KEYS[1], 'refused', 1)
  redis.call('HINCRBY', KEYS[1], 'refused:' .. limit, 1)
  return {1, math.max(1, math.ceil(wait)), 0, limit}
end
local rpm, tpd, maxq = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if tpd > 0 and tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0') >= tpd then
  return refuse('tokens_per_day', (day + 1) * 86400000 - now)
end
if maxq > 0 and open >= maxq then return refuse('max_queued', 1000) end
if rpm > 0 and ARGV[6] ~= '1' then
  local interval = 60000 / rpm
  local tat = math.max(tonumber(redis.call('HGET', KEYS[1], 'tat') or '0'), now)
  local early = tat + interval - 60000 - now
  if early > 0 then return refuse('rpm', early) end
  redis.call('HSET', KEYS[1], 'tat', string.format('%.3f', tat + interval))
end
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('HINCRBY', KEYS[1], 'requests', 1)
return {0, 0, open, ''}
