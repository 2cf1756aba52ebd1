-- start_item: a worker begins an item of a job; mark the job running and tell whether to go on.
-- KEYS[1] job HASH
-- KEYS[2] job counts HASH status -> jobs in it
-- ARGV[1] now
-- ARGV[2] (optional) 'chunk' when a chunk's run begins: the job's 'chunk_started_at' becomes ARGV[1]
--         where that is later (deadline admission reckons from it how long the job's running chunks still
--         hold their slots; two slots' calls may come out of order, and an earlier time would say too little)
-- Returns: the job's status after the call ('running', or 'cancelled' / 'failed' / 'succeeded'
-- when the item should be dropped unrun); '' when the job does not exist.
-- KEYS by name (the positions above are the callers' contract).
local K = {job = KEYS[1], job_counts = KEYS[2]}
local status = redis.call('HGET', K.job, 'status')
if not status then
  return ''
end
if status == 'queued' then
  redis.call('HSET', K.job, 'status', 'running')
  count_job_move(K.job, K.job_counts, status, 'running')
  redis.call('HSETNX', K.job, 'started_at', ARGV[1])
  status = 'running'
end
if status == 'running' and ARGV[2] == 'chunk'
    and tonumber(ARGV[1]) > tonumber(redis.call('HGET', K.job, 'chunk_started_at') or '0') then
  redis.call('HSET', K.job, 'chunk_started_at', ARGV[1])
end
return status
