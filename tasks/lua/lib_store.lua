-- lib_store.lua (shared functions)
-- Store a task's outcome unless it has one: the first outcome stays, except that a genuine
-- completion replaces a dead letter (the run the reaper gave up on finished after all). With
-- `only_over_dead` it is stored only over a dead letter (a run that lost its entry still counts
-- then). Returns 1 when stored. Arguments: result hash; result (msgpack), status, worker, attempt,
-- ttl ms, only_over_dead ('1' or '').
local function store(key, result, status, worker, attempt, ttl, only_over_dead)
  local cur = redis.call('HGET', key, 'status')
  if cur and not (cur == 'dead' and status == 'completed') then return 0 end
  if not cur and only_over_dead == '1' then return 0 end
  if cur then redis.call('DEL', key) end
  redis.call('HSET', key, 'result', result, 'status', status, 'worker', worker, 'attempt', attempt)
  redis.call('PEXPIRE', key, ttl)
  return 1
end
