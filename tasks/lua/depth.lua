-- depth.lua (script; loaded by tasks/store.py)
-- How many entries one model's queue holds, all its bands together (queued, and delivered ones not
-- yet finished). KEYS[1] the model's plain queue, KEYS[2] its zset of bands (same slot).
return depth(KEYS[1], KEYS[2])
