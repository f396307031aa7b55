-- quota_settle.lua (script; loaded by tasks/quota.py)
-- Settle a key's task: drop it from the open set and charge its tokens to today's count once per
-- task, whoever settles it and whenever (the charged set remembers each task charged for longer
-- than any completion can come late, independent of the open set, whose tasks expire). A settlement
-- with no tokens only gives back the task's open place, so that a later one with its tokens (the
-- projector's, from the ledger) still charges it. KEYS[1] the usage hash, KEYS[2] its open tasks,
-- KEYS[3] its charged tasks (zset task id -> charged at ms); ARGV task id, tokens, how long a
-- charged task is remembered (ms). Returns 1 when this call charged it or gave back its place.
local was_open = redis.call('ZREM', KEYS[2], ARGV[1])
local tokens = tonumber(ARGV[2])
if tokens <= 0 then return was_open end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[3]))
if redis.call('ZADD', KEYS[3], 'NX', now, ARGV[1]) == 0 then return was_open end
redis.call('PEXPIRE', KEYS[3], ARGV[3])
local day = math.floor(now / 86400000)
if tonumber(redis.call('HGET', KEYS[1], 'day') or '-1') ~= day then
  redis.call('HSET', KEYS[1], 'day', day, 'tokens', 0)
end
redis.call('HINCRBY', KEYS[1], 'tokens', tokens)
redis.call('HINCRBY', KEYS[1], 'tokens_total', tokens)
return 1
