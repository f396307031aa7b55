-- close_run.lua (script; loaded by tasks/store.py)
-- Close a run: its last text piece (if any), then its outcome (see lib_store.lua), at once. The done
-- chunk follows with the closing events (TaskStore.log_run), so that a client that sees it finds
-- the completion in the ledger. KEYS[1] result hash, KEYS[2] output stream; ARGV result (msgpack),
-- status, worker, attempt, ttl ms, text chunk ('' = none), output ttl ms, only_over_dead.
-- Returns 1 for the outcome that counts, 0 for any later one.
if ARGV[6] ~= '' then
  redis.call('XADD', KEYS[2], '*', 'c', ARGV[6])
  redis.call('PEXPIRE', KEYS[2], ARGV[7])
end
return store(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[8])
