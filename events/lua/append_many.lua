-- append_many.lua (script; loaded by events/ledger.py)
-- XADDs a whole batch in one round trip. ARGV[1] the packed batch; ARGV[2], when given, the ids to
-- write them under (for importing a history).
-- KEYS[1] the stream appended to (the ledger, or a worker's inbox).
return append_blob(KEYS[1], ARGV[1], ARGV[2])
