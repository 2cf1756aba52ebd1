-- start_item: a worker begins an item of a job; mark the job running and tell whether to go on.
-- KEYS[1] job HASH
-- KEYS[2] job counts HASH status -> jobs in it
-- ARGV[1] now
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
  return 'running'
end
return status
