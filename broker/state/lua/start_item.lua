-- start_item: a worker begins an item of a job; mark the job running and tell whether to go on.
-- KEYS[1] job HASH
-- KEYS[2] job counts HASH status -> jobs in it
-- ARGV[1] now
-- ARGV[2] (optional) 'chunk' when a chunk's run begins: the job's 'chunk_started_at' becomes ARGV[1]
--         where that is later (deadline admission reckons from it how long the job's running chunks still
--         hold their slots; two slots' calls may come out of order, and an earlier time would say too little)
-- Returns: the job's status after the call ('running', or 'cancelled' / 'failed' / 'succeeded'
-- when the item should be dropped unrun); '' when the job does not exist.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return ''
end
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'running')
  count_job_move(KEYS[1], KEYS[2], status, 'running')
  redis.call('HSETNX', KEYS[1], 'started_at', ARGV[1])
  status = 'running'
end
if status == 'running' and ARGV[2] == 'chunk'
    and tonumber(ARGV[1]) > tonumber(redis.call('HGET', KEYS[1], 'chunk_started_at') or '0') then
  redis.call('HSET', KEYS[1], 'chunk_started_at', ARGV[1])
end
return status
