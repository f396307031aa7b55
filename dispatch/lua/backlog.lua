-- backlog.lua (script; loaded by dispatch/view.py)
-- One model's waiting entries, head first, across its band queues in serving order (the zset of
-- bands, with the plain queue placed by its order ARGV[4]). Per queue: the re-queued entries (held
-- by the REQUEUED consumer, in their original place) and then those after the group's
-- last-delivered id (nobody has read them), at most ARGV[2] in all; and per queue the id of its
-- last entry (an XREAD from it wakes on the next new one). A missing queue or group reads from the
-- start; a key that is not a stream gives no entries.
-- KEYS[1] the plain queue, KEYS[2] the zset of bands (one slot: the band queues carry the plain
-- queue's name as hash tag); ARGV[1] group, ARGV[2] depth, ARGV[3] the REQUEUED consumer's name,
-- ARGV[4] the plain queue's order.
-- Returns {names, cursors, rows per queue}.
local left = tonumber(ARGV[2])
local function look(q, want)
  local rows = {}
  if want > 0 then
    local again = redis.pcall('XPENDING', q, ARGV[1], '-', '+', want, ARGV[3])
    if type(again) == 'table' and again.err == nil then
      for _, p in ipairs(again) do
        local r = redis.call('XRANGE', q, p[1], p[1])
        if #r > 0 then rows[#rows + 1] = r[1] end
      end
    end
  end
  local start, delivered = '-', '0-0'
  local groups = redis.pcall('XINFO', 'GROUPS', q)
  if type(groups) == 'table' and groups.err == nil then
    for _, g in ipairs(groups) do
      local name, last = nil, nil
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then last = g[j + 1] end
      end
      if name == ARGV[1] and last ~= nil and last ~= '0-0' then start, delivered = '(' .. last, last end
    end
  end
  local unread = 0
  if #rows < want then
    local more = redis.pcall('XRANGE', q, start, '+', 'COUNT', want - #rows)
    if type(more) == 'table' and more.err == nil then
      for _, r in ipairs(more) do rows[#rows + 1] = r end
      unread = #more
    end
  end
  -- With nothing unread, every entry after the group's cursor is new: it is the queue's cursor too
  -- (an idle worker's look costs no more reads).
  local cursor = delivered
  if unread > 0 or #rows >= want then
    local last = redis.pcall('XREVRANGE', q, '+', '-', 'COUNT', 1)
    if type(last) == 'table' and last.err == nil and #last > 0 then cursor = last[1][1] end
  end
  return cursor, rows
end
local names, placed = {}, false
local plain = tonumber(ARGV[4])
local listed = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
for i = 1, #listed, 2 do
  local q, score = listed[i], tonumber(listed[i + 1])
  if not placed and (q == KEYS[1] or score > plain) then
    names[#names + 1] = KEYS[1]
    placed = true
  end
  if q ~= KEYS[1] then names[#names + 1] = q end
end
if not placed then names[#names + 1] = KEYS[1] end
local cursors, found = {}, {}
for i, q in ipairs(names) do
  local cursor, rows = look(q, left)
  left = left - #rows
  cursors[i], found[i] = cursor, rows
end
return {names, cursors, found}
