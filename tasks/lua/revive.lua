-- revive.lua (script; loaded by tasks/store.py)
-- Find entries that were delivered and then left the pending list without being deleted, and put
-- each back as a re-queued entry, in its place (XCLAIM FORCE to the REQUEUED consumer). No routeledger
-- process makes one (every acknowledgement deletes its entry in the same script), but a consumer can:
-- XREADGROUP with NOACK, or XCLAIM with LASTID past entries nobody read; without this such a task
-- would wait forever, neither queued nor running. KEYS[1] queue; ARGV group, the REQUEUED consumer's
-- name, start id ('-' = the first), most entries to look at. Returns {revived, next start ('' = done)}
-- where revived holds {entry id, task id, attempt its next run gets} for each.
local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
if type(groups) ~= 'table' or groups.err then return {{}, ''} end
local last = nil
for _, g in ipairs(groups) do
  local name, delivered = nil, nil
  for j = 1, #g, 2 do
    if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then delivered = g[j + 1] end
  end
  if name == ARGV[1] then last = delivered end
end
if last == nil or last == '0-0' then return {{}, ''} end
local limit = tonumber(ARGV[4])
local rows = redis.call('XRANGE', KEYS[1], ARGV[3], last, 'COUNT', limit)
local revived = {}
for _, row in ipairs(rows) do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], row[1], row[1], 1) == 0 then
    local attempt, id = 1, ''
    local flat = row[2]
    for i = 1, #flat, 2 do
      if flat[i] == 'attempt' then attempt = tonumber(flat[i + 1]) or 1 end
      if flat[i] == 'id' then id = flat[i + 1] end
    end
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, row[1], 'RETRYCOUNT', attempt, 'FORCE', 'JUSTID')
    revived[#revived + 1] = {row[1], id, attempt + 1}
  end
end
if #rows < limit then return {revived, ''} end
return {revived, '(' .. rows[#rows][1]}
