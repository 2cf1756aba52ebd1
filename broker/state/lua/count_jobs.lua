-- count_jobs: add jobs stored before the per-status job counts existed to those counts, once each.
-- KEYS[1] job counts HASH status -> jobs in it
-- KEYS[2..] job HASHes (one that is gone, or already counted, is skipped)
-- Returns: how many jobs were counted now.
-- Atomic per job with every status change (`count_job_move` moves only jobs marked 'counted'), so a
-- job is in the counts exactly once, under the status it has.
-- KEYS by name (the positions above are the callers' contract).
local K = {job_counts = KEYS[1]}
local counted = 0
for i = 2, #KEYS do
  local status = redis.call('HGET', KEYS[i], 'status')
  if status and redis.call('HSETNX', KEYS[i], 'counted', '1') == 1 then
    redis.call('HINCRBY', K.job_counts, status, 1)
    counted = counted + 1
  end
end
return counted
