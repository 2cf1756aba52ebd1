-- stop_job: cancel or fail a job and take its waiting items out of the queue.
-- KEYS[1] job       HASH
-- KEYS[2] ready     ZSET
-- KEYS[3] inflight  ZSET
-- KEYS[4] items     HASH
-- KEYS[5] attempts  HASH
-- ARGV[1] new status ('cancelled' | 'failed'), ARGV[2] error text, ARGV[3] now
-- ARGV[4..] the job's item ids (chunks and its finalize item)
-- Returns: the job's status after the call. A job already finished keeps its status.
-- In-flight items are dropped too; a worker still running one sees the final status at ack.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return ''
end
if status ~= 'queued' and status ~= 'running' then
  return status
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'error', ARGV[2], 'finished_at', ARGV[3])
for i = 4, #ARGV do
  redis.call('ZREM', KEYS[2], ARGV[i])
  redis.call('ZREM', KEYS[3], ARGV[i])
  redis.call('HDEL', KEYS[4], ARGV[i])
  redis.call('HDEL', KEYS[5], ARGV[i])
end
return ARGV[1]
