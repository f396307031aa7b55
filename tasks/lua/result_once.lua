-- result_once.lua (script; loaded by tasks/store.py)
-- Record a task's outcome (see lib_store.lua). KEYS[1] result hash; ARGV result (msgpack), status,
-- worker, attempt, ttl ms. Returns 1 for the outcome that counts, 0 for any later one.
return store(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], '')
