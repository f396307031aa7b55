-- lib_append_blob.lua (shared functions)
-- A Lua function that XADDs a packed batch of events to `stream`: `blob` is codec.encode_batch's
-- packing (per event the lengths of type, v and data (>HHI4), then the three strings); `given`, when
-- not nil, holds the ids to write them under (space-separated), else Redis makes them. Returns the
-- ids. Shared by every script that appends events together with another change.
local function append_blob(stream, blob, given)
  local size = #blob
  local pos = 1
  local next_given = given and string.gmatch(given, '%S+')
  local ids = {}
  local n = 0
  while pos <= size do
    local lt, lv, ld, at = struct.unpack('>HHI4', blob, pos)
    local kind = string.sub(blob, at, at + lt - 1)
    at = at + lt
    local v = string.sub(blob, at, at + lv - 1)
    at = at + lv
    pos = at + ld
    n = n + 1
    local id = next_given and next_given() or '*'
    ids[n] = redis.call('XADD', stream, id, 'type', kind, 'v', v, 'data', string.sub(blob, at, pos - 1))
  end
  return ids
end
