-- note_failure: record one failure of an item on its job's or request's record (`note_failure` in
-- lib.lua), for a failure whose item another script already moved: a lost lease the reaper returned.
-- KEYS[1] record HASH the item's job, or the request itself
-- KEYS[2] counters HASH running totals for /metrics ('failures_retried_<class>:<model ref>', or _final_)
-- ARGV[1] item id, ARGV[2] now, ARGV[3] JSON {class, error, retry_at (null: not retried), model: its model ref}
-- Returns 1.
-- KEYS by name (the positions above are the callers' contract).
local K = {record = KEYS[1], counters = KEYS[2]}
local options = cjson.decode(ARGV[3])
local retry_at = options.retry_at
if retry_at == cjson.null then
  retry_at = nil
end
note_failure(K.record, ARGV[1], options.class, options.error, tonumber(ARGV[2]), retry_at, false)
local outcome = retry_at == nil and 'final' or 'retried'
redis.call('HINCRBY', K.counters, 'failures_' .. outcome .. '_' .. options.class .. ':' .. options.model, 1)
return 1
