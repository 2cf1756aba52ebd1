-- retry_item: a leased item's run failed in a class that may be retried: record the failure and, while
-- the class has retries left, park the item in flight until its backoff has passed (the reaper then
-- returns it to its queue at its own score, `reap_leases.lua`); no worker thread waits.
-- KEYS[1] inflight  ZSET item id -> lease deadline; a parked item's is when it may run again
-- KEYS[2] retrying  ZSET item id -> when it may run again, of the parked items (the reaper tells them
--           from lost leases by it)
-- KEYS[3] attempts  HASH item id -> lease count; a parked item's lease is not counted (that count
--           bounds lost leases only, `retry.worker_lost`)
-- KEYS[4] record    HASH the item's job, or the request itself (`note_failure` in lib.lua)
-- KEYS[5] counters  HASH running totals for /metrics: 'failures_retried_<class>:<model ref>' or
--           'failures_final_<class>:<model ref>' counts this failure
-- ARGV[1] item id, ARGV[2] now
-- ARGV[3] JSON {class, error, delays: [the wait before retry 1, 2, ...], count_field: the record field
--           that counts this item's failures of the class, model: the item's model ref}
-- Returns {RETRY.PARKED, n, retry_at}: parked after its n-th failure in the class; {RETRY.NOT_RETRIED, n}:
-- not retried, the item failed n times in the class (the caller fails it); {RETRY.NOT_IN_FLIGHT}: the item
-- is no longer in flight (reaped, finished or stopped meanwhile).
-- KEYS by name (the positions above are the callers' contract).
local K = {inflight = KEYS[1], retrying = KEYS[2], attempts = KEYS[3], record = KEYS[4], counters = KEYS[5]}
if not redis.call('ZSCORE', K.inflight, ARGV[1]) then
  return {RETRY.NOT_IN_FLIGHT}
end
local options = cjson.decode(ARGV[3])
local now = tonumber(ARGV[2])
local failures = 1
if redis.call('EXISTS', K.record) == 1 then
  failures = redis.call('HINCRBY', K.record, options.count_field, 1)
end
local delay = options.delays[failures]
local retry_at = nil
if delay ~= nil then
  retry_at = now + delay
end
local class = options.class
note_failure(K.record, ARGV[1], class, options.error, now, retry_at, options.count_field == 'attempts:' .. class)
local outcome = retry_at == nil and 'final' or 'retried'
redis.call('HINCRBY', K.counters, 'failures_' .. outcome .. '_' .. class .. ':' .. options.model, 1)
if retry_at == nil then
  return {RETRY.NOT_RETRIED, failures}
end
redis.call('ZADD', K.inflight, 'XX', retry_at, ARGV[1])
redis.call('ZADD', K.retrying, retry_at, ARGV[1])
if tonumber(redis.call('HINCRBY', K.attempts, ARGV[1], -1)) <= 0 then
  redis.call('HDEL', K.attempts, ARGV[1])
end
return {RETRY.PARKED, failures, tostring(retry_at)}
