-- stop_job: cancel or fail a job and take its waiting items out of the queue.
-- KEYS[1] job       HASH
-- KEYS[2] ready     ZSET
-- KEYS[3] inflight  ZSET
-- KEYS[4] items     HASH
-- KEYS[5] attempts  HASH
-- KEYS[6] dead      ZSET
-- KEYS[7] job counts HASH status -> jobs in it
-- ARGV[1] new status ('cancelled' | 'failed'), ARGV[2] error text, ARGV[3] now
-- ARGV[4] a dead item that causes the stop, or '': the stop happens only if that item is still
--         dead (a resume in between took it back, and then the job must not fail)
-- ARGV[5] 'first', or 'more' for a later call of the same stop (a job's items come in slices of
--         `jobs.ENQUEUE_SLICE`): it only takes items out, and only while the job still has the status
--         the first call gave it (a resume in between re-queued them)
-- ARGV[6..] the job's item ids (chunks and its finalize item)
-- Returns: the job's status after the call, or 'skipped'. A job already finished keeps its status.
-- In-flight items are dropped too; a worker still running one sees the final status at ack.
if ARGV[4] ~= '' then
  if redis.call('ZREM', KEYS[6], ARGV[4]) == 0 then
    return 'skipped'
  end
  redis.call('HDEL', KEYS[4], ARGV[4])
  redis.call('HDEL', KEYS[5], ARGV[4])
end
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return ''
end
if ARGV[5] == 'more' then
  if status ~= ARGV[1] then
    return status
  end
elseif status ~= 'queued' and status ~= 'running' then
  return status
else
  redis.call('HSET', KEYS[1], 'status', ARGV[1], 'error', ARGV[2], 'finished_at', ARGV[3])
  count_job_move(KEYS[1], KEYS[7], status, ARGV[1])
end
for i = 6, #ARGV do
  redis.call('ZREM', KEYS[2], ARGV[i])
  redis.call('ZREM', KEYS[3], ARGV[i])
  redis.call('ZREM', KEYS[6], ARGV[i])
  redis.call('HDEL', KEYS[4], ARGV[i])
  redis.call('HDEL', KEYS[5], ARGV[i])
end
return ARGV[1]
