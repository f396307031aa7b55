-- lib_handoff.lua (shared functions)
-- Lua helpers of the hand-off scripts: a stream id as (ms, seq) numbers, a group's last delivered id
-- (nil: the stream is gone), and the group made on a queue that may not have it yet.
local function key(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function last_delivered(stream, group)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if not ok then return nil end
  local last = '0-0'
  for _, g in ipairs(groups) do
    local name, delivered = nil, nil
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then delivered = g[j + 1] end
    end
    if name == group and delivered ~= nil then last = delivered end
  end
  return last
end
local function ensure_group(stream, group)
  local made = redis.pcall('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
  if type(made) == 'table' and made.err and not string.find(made.err, 'BUSYGROUP') then
    return made.err
  end
  return nil
end
