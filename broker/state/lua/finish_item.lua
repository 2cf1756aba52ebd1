-- finish_item: remove an item that needs no further run (finalized, dropped or failed),
-- optionally moving its job to a final status.
-- KEYS[1] inflight  ZSET
-- KEYS[2] ready     ZSET
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
local status = redis.call('HGET', KEYS[6], 'status')
local active = status == 'queued' or status == 'running'
if ARGV[2] == '' and active then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
local published = ARGV[2] == 'succeeded' and (status == 'cancelled' or status == 'failed')
if ARGV[2] ~= '' and (active or published) then
  redis.call('HSET', KEYS[6], 'status', ARGV[2], 'error', ARGV[3], 'finished_at', ARGV[4])
  count_job_move(KEYS[6], KEYS[7], status, ARGV[2])
  count_job_end(KEYS[6], ARGV[6], status, ARGV[2], tonumber(ARGV[4]), KEYS[8], KEYS[9], KEYS[10])
  for name, value in pairs(cjson.decode(ARGV[5])) do
    redis.call('HSET', KEYS[6], name, tostring(value))
  end
end
return 1
