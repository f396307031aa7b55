-- field_of.lua (script; loaded by projections/projector.py)
-- One field of each hash in KEYS (task records, which share the core's slot on a cluster), in one
-- call: a pipeline of HGETs costs a cluster client far more per command than one script does.
-- KEYS the hashes; ARGV[1] the field.
-- Returns the field's value in each hash, in the order of KEYS (nil where a hash lacks it).
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call('HGET', key, ARGV[1])
end
return out
