-- take.lua (script; loaded by tasks/store.py)
-- Take exactly one entry for a consumer: the oldest re-queued one, else the head of what nobody has
-- read, and only when it is the entry the caller's gate decided on (ARGV[3]; '' takes the head,
-- whatever it is), or an equivalent: when the plan gave the caller task #k (ARGV[5] = k - 1, the
-- slack) and at most k - 1 entries from the expected one on were taken by others meanwhile, the
-- caller's place in that plan still stands, and the head now is what it takes (the tasks of one
-- queue are alike to the plan but for their order). A queue or group that a restart of Redis lost is
-- made again.
-- KEYS[1] queue; ARGV group, consumer, expected entry id, the REQUEUED consumer's name, slack.
-- Returns {entry id, attempt, fields, cursor}: entry id '' when nothing was taken, with the id of the
-- queue's last entry as `cursor` (XREAD from it wakes on the next new one); attempt -1 when the
-- taken entry had been deleted meanwhile (look again at once).
local function cursor()
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  if #last == 0 then return '0-0' end
  return last[1][1]
end
local again = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[4])
if type(again) == 'table' and again.err then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
  again = {}
end
if #again > 0 then
  local id = again[1][1]
  if ARGV[3] ~= '' and id ~= ARGV[3] then return {'', 0, {}, cursor()} end
  local attempt = tonumber(again[1][4]) + 1
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'RETRYCOUNT', attempt, 'JUSTID')
  local rows = redis.call('XRANGE', KEYS[1], id, id)
  if #rows == 0 then
    -- pcall: a worker's ACL has no XACK; the reaper acknowledges the empty entry later.
    redis.pcall('XACK', KEYS[1], ARGV[1], id)
    return {'', -1, {}, ''}
  end
  return {id, attempt, rows[1][2], ''}
end
if ARGV[3] ~= '' then
  local last = '0-0'
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local name, delivered = nil, nil
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then delivered = g[j + 1] end
    end
    if name == ARGV[1] and delivered ~= nil then last = delivered end
  end
  local head = redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', 1)
  if #head == 0 then return {'', 0, {}, cursor()} end
  if head[1][1] ~= ARGV[3] then
    local slack = tonumber(ARGV[5] or '0')
    local function key(id)
      local ms, seq = string.match(id, '^(%d+)-(%d+)$')
      return tonumber(ms), tonumber(seq)
    end
    local ems, eseq = key(ARGV[3])
    local lms, lseq = key(last)
    local delivered = ems ~= nil and lms ~= nil and (ems < lms or (ems == lms and eseq <= lseq))
    if slack < 1 or not delivered then return {'', 0, {}, cursor()} end
    local taken = redis.call('XRANGE', KEYS[1], ARGV[3], last, 'COUNT', slack + 1)
    if #taken > slack then return {'', 0, {}, cursor()} end
  end
end
local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[1], '>')
if not got then return {'', 0, {}, cursor()} end
local row = got[1][2][1]
local attempt = 1
local flat = row[2]
for i = 1, #flat, 2 do if flat[i] == 'attempt' then attempt = tonumber(flat[i + 1]) end end
if attempt > 1 then
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, row[1], 'RETRYCOUNT', attempt, 'JUSTID')
end
return {row[1], attempt, flat, ''}
