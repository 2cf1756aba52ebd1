-- enqueue_items: add items to a model's ready queue (and optionally create the job they belong to).
-- A job's items may come in several calls (`broker.jobs.slices.ENQUEUE_SLICE` each), so that no call holds Redis
-- long; while they do, the job is in the filling index, and a reaper pass completes a fill whose
-- caller died (`broker.jobs.fills.refill_job`).
-- KEYS[1] ready   ZSET  item id -> score (and its tenants' indexes beside it: lib.lua's `ready_add`)
-- KEYS[2] items   HASH  item id -> JSON payload
-- KEYS[3] queues  SET   model refs with a queue
-- KEYS[4] job     HASH  the job (only read when ARGV[2] ~= '')
-- KEYS[5] jobs    ZSET  job id -> created time
-- KEYS[6] done    SET   chunk indexes already done for the job
-- KEYS[7] inflight ZSET item id -> lease deadline
-- KEYS[8] dead     ZSET items that used up their attempts
-- KEYS[9] attempts HASH item id -> lease count
-- KEYS[10] filling ZSET job id -> time of its last enqueue call, while more calls are to come
-- KEYS[11] job counts HASH status -> jobs in it (a job's status set through ARGV[3] is counted)
-- KEYS[12] queues version STRING counter (moves when KEYS[3] gains a ref)
-- KEYS[13] cuts   HASH  chunk index -> 'start,stop' of the job's chunks split as they ran (broker/jobs/cuts.py):
--         a chunk queued here gets that range, whatever its caller read before a split
-- KEYS[14..] the job's own indexes ZSET job id -> created time: its owner's, its tenant's (optional; 'create'
--         adds the job to each)
-- ARGV[1] model ref
-- ARGV[2] job id, or '' for items without a job
-- ARGV[3] JSON object of job fields to set (or '{}'); 'create' also marks the job counted in KEYS[11]
-- ARGV[4] 'create' (the job must not exist yet) | 'resume' (leased items are taken back: their
--         holders are dead, or if not, their duplicate run rewrites identical bytes; dead items
--         come back with fresh attempts, since the user asked to try again) | 'add' (a dead item stays
--         out: it fails its job). A 'more' or 'last' call of a resume takes back only chunks after those
--         its fill handled already (`filled_to`): the new run may hold those (a reaper pass completing the
--         fill beside another pass, or beside a slow caller), and taking them back again would run them twice
-- ARGV[5] now (unix seconds)
-- ARGV[6] '' (the job's only call) | 'first' (more calls follow) | 'more' | 'last': a 'more' or
--         'last' call adds nothing to a job no longer queued or running (cancelled meanwhile).
--         A fill records itself in the job, so that a reaper pass completes it as it began: '' and
--         'first' set `fill_id` (ARGV[8]) and `fill_mode` ('resume', or 'add' for any other mode), every
--         call of that fill `filled_to` (the highest chunk index the fill has handled; chunks come in
--         ascending order). A '' call queues all the job lacks, so it also ends the record of an earlier
--         fill of the job cut short. A 'more' or 'last' call of a fill that a later one took over (its id is
--         not the recorded one) only adds what is missing: it takes nothing back and leaves the record and
--         the filling entry to the later fill (a reaper pass must not end a resume begun after it read the job)
-- ARGV[7] the time of this call (unix seconds; ARGV[5] is the request's, taken before the input was
--         hashed): the job's score in the filling index, so that a fill going on is never taken for stalled
-- ARGV[8] the fill's id ('' matches a job recorded before fills had one)
-- ARGV[9..] groups of four: item id, score, payload JSON, chunk index ('' for non-chunk items)
-- Returns: number of items added; ENQUEUE.JOB_EXISTS if 'create' found the job already there;
-- ENQUEUE.JOB_STOPPED if a later call found the job stopped.
-- A chunk already in the done set, or already queued or leased, is skipped: nothing runs twice. So is a
-- dead one that the call does not take back: it is never in the dead set and ready at once.
-- KEYS by name (the positions above are the callers' contract).
local K = {ready = KEYS[1], items = KEYS[2], queues = KEYS[3], job = KEYS[4], jobs = KEYS[5],
  done = KEYS[6], inflight = KEYS[7], dead = KEYS[8], attempts = KEYS[9], filling = KEYS[10],
  job_counts = KEYS[11], queues_version = KEYS[12], cuts = KEYS[13], job_indexes = {unpack(KEYS, 14)}}
local job_id, fill, fill_id = ARGV[2], ARGV[6], ARGV[8]
if ARGV[4] == 'create' and redis.call('EXISTS', K.job) == 1 then
  return ENQUEUE.JOB_EXISTS
end
local own = true  -- the job's fill record (`fill_id`, `fill_mode`, `filled_to`, its filling entry) is this fill's
if job_id ~= '' and (fill == 'more' or fill == 'last') then
  own = (redis.call('HGET', K.job, 'fill_id') or '') == fill_id
end
if fill == 'more' or fill == 'last' then
  local status = redis.call('HGET', K.job, 'status')
  if status ~= 'queued' and status ~= 'running' then
    if own then
      redis.call('ZREM', K.filling, job_id)
    end
    return ENQUEUE.JOB_STOPPED
  end
end
if own and (fill == 'first' or fill == 'more') then
  redis.call('ZADD', K.filling, ARGV[7], job_id)
elseif own and job_id ~= '' then
  redis.call('ZREM', K.filling, job_id)
end
if job_id ~= '' then
  local fields = cjson.decode(ARGV[3])
  local old_status = redis.call('HGET', K.job, 'status')
  if ARGV[4] == 'create' then
    redis.call('HSET', K.job, 'counted', '1')
  end
  for name, value in pairs(fields) do
    redis.call('HSET', K.job, name, tostring(value))
  end
  if fields['status'] then
    count_job_move(K.job, K.job_counts, old_status, tostring(fields['status']))
  end
  redis.call('ZADD', K.jobs, 'NX', ARGV[5], job_id)
  for _, index in ipairs(K.job_indexes) do
    redis.call('ZADD', index, 'NX', ARGV[5], job_id)
  end
end
local filled_to = -1  -- chunks up to this index were handled by earlier calls of this fill
if job_id ~= '' then
  if fill == '' or fill == 'first' then
    redis.call('HSET', K.job, 'fill_mode', ARGV[4] == 'resume' and 'resume' or 'add', 'fill_id', fill_id)
  elseif own then
    filled_to = tonumber(redis.call('HGET', K.job, 'filled_to')) or -1
  end
end
local take_back = own and ARGV[4] == 'resume'
local has_cuts = job_id ~= '' and redis.call('HLEN', K.cuts) > 0
local handled_to = filled_to
local added = 0
local job_tenant = nil  -- the tenant index the job's items go to (lib.lua's `ready_add`)
for i = 9, #ARGV, 4 do
  local item_id, score, payload, chunk = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local index = tonumber(chunk)
  local done = chunk ~= '' and redis.call('SISMEMBER', K.done, chunk) == 1
  if index and index > handled_to then
    handled_to = index
  end
  if not done then
    local leased = redis.call('ZSCORE', K.inflight, item_id)
    if take_back and (not index or index > filled_to) then
      redis.call('ZREM', K.inflight, item_id)
      redis.call('ZREM', K.dead, item_id)
      redis.call('HDEL', K.attempts, item_id)
      leased = false
    end
    -- a dead item not taken back stays out of ready: it fails its job (`stop_job` with a dead item)
    local queued_or_dead = redis.call('ZSCORE', K.ready, item_id) or redis.call('ZSCORE', K.dead, item_id)
    if not leased and not queued_or_dead then
      local cut = has_cuts and index and redis.call('HGET', K.cuts, chunk)
      if cut then  -- (split since the caller read the job's chunks)
        local decoded = cjson.decode(payload)
        local comma = string.find(cut, ',', 1, true)
        decoded['start'], decoded['stop'] = tonumber(string.sub(cut, 1, comma - 1)), tonumber(string.sub(cut, comma + 1))
        payload = cjson.encode(decoded)
      end
      redis.call('HSET', K.items, item_id, payload)
      if job_tenant == nil or job_id == '' then  -- (a job's items are all its tenant's: one decode)
        job_tenant = item_tenant(cjson.decode(payload))
      end
      ready_add(K.ready, item_id, score, job_tenant)
      added = added + 1
    end
  end
end
if job_id ~= '' and own then
  redis.call('HSET', K.job, 'filled_to', handled_to)
end
add_queue(K.queues, K.queues_version, ARGV[1], K.ready)
return added
