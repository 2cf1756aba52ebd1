-- finish_item: remove an item that needs no further run (finalized, dropped or failed),
-- optionally moving its job to a final status.
-- KEYS[1] inflight  ZSET
-- KEYS[2] ready     ZSET (and its tenants' indexes beside it: lib.lua's `ready_remove`)
-- KEYS[3] items     HASH
-- KEYS[4] attempts  HASH
-- KEYS[5] dead      ZSET
-- KEYS[6] job       HASH (may not exist)
-- KEYS[7] job counts HASH status -> jobs in it
-- KEYS[8] counters  HASH running totals for /metrics (a job's deadline met or missed: `count_job_end`)
-- KEYS[9] latency buckets HASH the latency histograms (a succeeded job's time from submit to finish)
-- KEYS[10] jobs due ZSET job id -> deadline, of active jobs with one (a job that ends leaves it)
-- ARGV[1] item id
-- ARGV[2] new job status ('' to leave it), ARGV[3] error text, ARGV[4] now
-- ARGV[5] JSON object of extra job fields to set (e.g. the manifest), ARGV[6] the job id ('' for none)
-- Returns: 1. A job already in a final status keeps it (a late duplicate cannot undo a cancel), but
-- 'succeeded' (sent only by a finalize step whose manifest is published) replaces 'cancelled' or
-- 'failed': the step found the job active just before publishing, so that stop landed while the
-- folder got (or after it had got) the job's complete results, and status and folder must agree.
-- Returns 0, changing nothing, for an item dropped (ARGV[2] '': its worker found the job stopped)
-- of a job that is active again: a resume since has queued it again (and another worker may hold it
-- already), and took the dropper's lease back with it.
-- KEYS by name (the positions above are the callers' contract).
local K = {inflight = KEYS[1], ready = KEYS[2], items = KEYS[3], attempts = KEYS[4], dead = KEYS[5],
  job = KEYS[6], job_counts = KEYS[7], counters = KEYS[8], latency_buckets = KEYS[9], jobs_due = KEYS[10]}
local status = redis.call('HGET', K.job, 'status')
local active = status == 'queued' or status == 'running'
if ARGV[2] == '' and active then
  return 0
end
redis.call('ZREM', K.inflight, ARGV[1])
ready_remove_stored(K.ready, K.items, ARGV[1])
redis.call('HDEL', K.items, ARGV[1])
redis.call('HDEL', K.attempts, ARGV[1])
redis.call('ZREM', K.dead, ARGV[1])
local published = ARGV[2] == 'succeeded' and (status == 'cancelled' or status == 'failed')
if ARGV[2] ~= '' and (active or published) then
  redis.call('HSET', K.job, 'status', ARGV[2], 'error', ARGV[3], 'finished_at', ARGV[4])
  count_job_move(K.job, K.job_counts, status, ARGV[2])
  count_job_end(K.job, ARGV[6], status, ARGV[2], tonumber(ARGV[4]), K.counters, K.latency_buckets, K.jobs_due)
  for name, value in pairs(cjson.decode(ARGV[5])) do
    redis.call('HSET', K.job, name, tostring(value))
  end
end
return 1
