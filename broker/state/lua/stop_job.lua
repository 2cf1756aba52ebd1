-- stop_job: cancel or fail a job and take its waiting items out of the queue.
-- A job's items are taken out in calls of `broker.jobs.slices.ENQUEUE_SLICE`, as they were queued; while more calls
-- are to come, the job is in the stopping index, and a reaper pass completes a stop whose caller died
-- (`broker.jobs.stops.finish_stop`).
-- KEYS[1] job       HASH
-- KEYS[2] ready     ZSET (and its tenants' indexes beside it: lib.lua's `ready_remove`)
-- KEYS[3] inflight  ZSET
-- KEYS[4] items     HASH
-- KEYS[5] attempts  HASH
-- KEYS[6] dead      ZSET
-- KEYS[7] job counts HASH status -> jobs in it
-- KEYS[8] stopping  ZSET job id -> time of its stop's last call, while more calls are to come
-- KEYS[9] counters  HASH running totals for /metrics (a failed job's deadline missed: `count_job_end`)
-- KEYS[10] latency buckets HASH the latency histograms (`count_job_end`)
-- KEYS[11] jobs due ZSET job id -> deadline, of active jobs with one (a stopped job leaves it)
-- ARGV[1] new status ('cancelled' | 'failed'); in a 'more' or 'last' call, the status the stop gave
-- ARGV[2] error text, ARGV[3] now
-- ARGV[4] a dead item that causes the stop, or '': the stop happens only if that item is still
--         dead (a resume in between took it back, and then the job must not fail)
-- ARGV[5] '' (the stop's only call) | 'first' (more calls follow) | 'more' | 'last': a 'more' or 'last'
--         call only takes items out, and only while the job still has the status and the stop id the
--         first call gave it (a resume in between re-queued them; a later stop took this one over)
-- ARGV[6] the stop's id, recorded in the job (`stop_id`) by a '' or 'first' call, also on a job that
--         already has the status ARGV[1]: a second stop (a second DELETE) takes an unfinished one over
-- ARGV[7] the job id (its member in KEYS[8])
-- ARGV[8] the time of this call (unix seconds): the job's score in KEYS[8]
-- ARGV[9..] the job's item ids (chunks and its finalize item)
-- Returns: the job's status after the call, 'skipped', 'superseded' (a 'more' or 'last' call of a stop
-- that a later one took over), or 'already': the job has the status ARGV[1] from a stop that finished
-- (its '' or 'last' call recorded `stop_done`), so there is nothing to take out (a second DELETE costs
-- one call, not a walk of every item). A job already finished keeps its status.
-- In-flight items are dropped too; a worker still running one sees the final status at ack.
-- KEYS by name (the positions above are the callers' contract).
local K = {job = KEYS[1], ready = KEYS[2], inflight = KEYS[3], items = KEYS[4], attempts = KEYS[5],
  dead = KEYS[6], job_counts = KEYS[7], stopping = KEYS[8], counters = KEYS[9], latency_buckets = KEYS[10],
  jobs_due = KEYS[11]}
local call, stop_id, job_id = ARGV[5], ARGV[6], ARGV[7]
if ARGV[4] ~= '' then
  if redis.call('ZREM', K.dead, ARGV[4]) == 0 then
    return 'skipped'
  end
  redis.call('HDEL', K.items, ARGV[4])
  redis.call('HDEL', K.attempts, ARGV[4])
end
local status = redis.call('HGET', K.job, 'status')
if call == 'more' or call == 'last' then
  local recorded = redis.call('HGET', K.job, 'stop_id') or ''
  if status ~= ARGV[1] or recorded ~= stop_id then
    -- this stop is over; its index entry goes unless another stop of the job is going on (that one's)
    if recorded == stop_id or (status ~= 'cancelled' and status ~= 'failed') then
      redis.call('ZREM', K.stopping, job_id)
    end
    if status == ARGV[1] then
      return 'superseded'
    end
    return status or ''
  end
elseif not status then
  return ''
elseif status == 'queued' or status == 'running' then
  redis.call('HSET', K.job, 'status', ARGV[1], 'error', ARGV[2], 'finished_at', ARGV[3], 'stop_id', stop_id)
  count_job_move(K.job, K.job_counts, status, ARGV[1])
  count_job_end(K.job, job_id, status, ARGV[1], tonumber(ARGV[3]), K.counters, K.latency_buckets, K.jobs_due)
elseif status == ARGV[1] then
  local finished = redis.call('HGET', K.job, 'stop_done')
  if finished and finished == redis.call('HGET', K.job, 'stop_id') and not redis.call('ZSCORE', K.stopping, job_id) then
    -- the last stop took every item out and nothing queues a stopped job's items again: nothing to do
    return 'already'
  end
  redis.call('HSET', K.job, 'stop_id', stop_id)
else
  return status
end
for i = 9, #ARGV do
  ready_remove_stored(K.ready, K.items, ARGV[i])
  redis.call('ZREM', K.inflight, ARGV[i])
  redis.call('ZREM', K.dead, ARGV[i])
  redis.call('HDEL', K.items, ARGV[i])
  redis.call('HDEL', K.attempts, ARGV[i])
end
if call == 'first' then
  redis.call('ZADD', K.stopping, ARGV[8], job_id)
elseif call == 'more' then
  redis.call('ZADD', K.stopping, 'XX', ARGV[8], job_id)  -- gone: another caller of this stop completed it
else
  redis.call('ZREM', K.stopping, job_id)
  redis.call('HSET', K.job, 'stop_done', stop_id)  -- this stop took every item out
end
return ARGV[1]
