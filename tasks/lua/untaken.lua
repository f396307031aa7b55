-- untaken.lua (script; loaded by tasks/store.py)
-- The entries of a pinned stream nobody has taken yet: {id, task id, ...} in order, at most ARGV[2]
-- of them. KEYS[1] the pinned stream; ARGV[1] group, ARGV[2] count.
local last = last_delivered(KEYS[1], ARGV[1])
if last == nil then return {} end
local out = {}
for _, row in ipairs(redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', tonumber(ARGV[2]))) do
  local ident = ''
  local flat = row[2]
  for i = 1, #flat, 2 do if flat[i] == 'id' then ident = flat[i + 1] end end
  out[#out + 1] = row[1]
  out[#out + 1] = ident
end
return out
