-- ack_chunk: a chunk's outputs are on disk; drop its lease and record it in the job's checkpoint.
-- KEYS[1] inflight  ZSET
-- KEYS[2] ready     ZSET (the item may have been reaped back while its first run finished), with its tenants'
--           indexes (lib.lua's `ready_add`)
-- KEYS[3] items     HASH
-- KEYS[4] attempts  HASH
-- KEYS[5] job       HASH
-- KEYS[6] done      SET  chunk indexes done
-- KEYS[7] doorbell  LIST an idle drain task blocks on (rung when the finalize item is queued)
-- KEYS[8] job counts HASH status -> jobs in it (a queued job becomes running)
-- KEYS[9] counters  HASH running totals for /metrics: 'job_rows:<model ref>' counts the chunk's rows once
-- KEYS[10] queues   SET model refs with a queue, KEYS[11] its version: the finalize item's queue is in it
-- KEYS[12] latency buckets HASH the chunk's run (ARGV[10]) counts in its model's `chunk` histogram, by its job's
--           priority class (`broker.monitoring.sla_metrics`), once, as its rows are
-- ARGV[1] item id
-- ARGV[2] chunk index
-- ARGV[3] rows in the chunk (its stored payload's, where it is still stored: a split may have shortened it
--         since the run read it, broker/jobs/cuts.py)
-- ARGV[4] now
-- ARGV[5] finalize item id, ARGV[6] its score, ARGV[7] its payload (score replaced by the chunk's current one)
-- ARGV[8] name of the worker that ran the chunk (counted in the job field 'w:<name>')
-- ARGV[9] the job's model ref
-- ARGV[10] seconds the chunk's stream slot ran it, added once to the job field 'busy_seconds' (the slot
--          time deadline admission calibrates a model's speed by); not for a run whose item was reaped
--          back to its queue meanwhile or leased more than once: the job is marked 'slot_time_partial'
--          instead, and calibrates nothing
-- ARGV[11] JSON {neighbour model version or 'alone': seconds of the chunk's run beside it}, added to the
--          job field 'slot_mix' ({neighbour: [seconds, rows]}, the chunk's rows split as its seconds;
--          admission learns from it how each pair of models slows each other down)
-- Returns: ACK.SKIPPED duplicate or job no longer active, ACK.RECORDED, ACK.LAST_CHUNK recorded and the job's last chunk
-- (the finalize item was queued and the doorbell rung: a lingering drain task of the acking worker,
-- which keeps its ticket while commits are pending, leases it at once). Idempotent: a re-run
-- chunk is counted once.
-- The finalize step inherits the chunk's score as it is now (a hot re-score may have changed it
-- while the chunk ran), not as the worker leased it.
-- KEYS by name (the positions above are the callers' contract).
local K = {inflight = KEYS[1], ready = KEYS[2], items = KEYS[3], attempts = KEYS[4], job = KEYS[5],
  done = KEYS[6], doorbell = KEYS[7], job_counts = KEYS[8], counters = KEYS[9], queues = KEYS[10],
  queues_version = KEYS[11], latency_buckets = KEYS[12]}
local finalize_score, finalize_payload = ARGV[6], ARGV[7]
local rows = tonumber(ARGV[3])
local current = redis.call('HGET', K.items, ARGV[1])
if current then
  local decoded, chunk = cjson.decode(finalize_payload), cjson.decode(current)
  decoded['score'], decoded['factors'] = chunk['score'], chunk['factors']
  finalize_score, finalize_payload = decoded['score'], cjson.encode(decoded)
  if chunk['stop'] and chunk['start'] then
    rows = tonumber(chunk['stop']) - tonumber(chunk['start'])
  end
end
redis.call('ZREM', K.inflight, ARGV[1])
local reaped = ready_remove_stored(K.ready, K.items, ARGV[1])
local leases = tonumber(redis.call('HGET', K.attempts, ARGV[1]) or '1')
redis.call('HDEL', K.items, ARGV[1])
redis.call('HDEL', K.attempts, ARGV[1])
redis.call('HINCRBY', K.job, 'chunk_runs', 1)
local status = redis.call('HGET', K.job, 'status')
if status ~= 'queued' and status ~= 'running' then
  return ACK.SKIPPED
end
if redis.call('SADD', K.done, ARGV[2]) == 0 then
  return ACK.SKIPPED
end
redis.call('HINCRBY', K.job, 'rows_done', rows)
if reaped or leases > 1 then
  -- a run whose lease was lost (frozen, cut off) or that was leased before: its time is no measure of
  -- the model's speed, and the job's slot time is no longer whole
  redis.call('HSET', K.job, 'slot_time_partial', '1')
elseif tonumber(ARGV[10] or '') then
  redis.call('HINCRBYFLOAT', K.job, 'busy_seconds', ARGV[10])
end
if not reaped and leases <= 1 and ARGV[11] and ARGV[11] ~= '' and ARGV[11] ~= '{}' then
  local beside, total = cjson.decode(ARGV[11]), 0
  for _, seconds in pairs(beside) do total = total + seconds end
  if total > 0 then
    local raw = redis.call('HGET', K.job, 'slot_mix')
    local mix = raw and cjson.decode(raw) or {}
    for neighbour, seconds in pairs(beside) do
      local was = mix[neighbour] or {0, 0}
      mix[neighbour] = {was[1] + seconds, was[2] + rows * seconds / total}
    end
    redis.call('HSET', K.job, 'slot_mix', cjson.encode(mix))
  end
end
redis.call('HINCRBY', K.counters, 'job_rows:' .. ARGV[9], rows)
local run_seconds = tonumber(ARGV[10] or '')
if run_seconds and run_seconds > 0 then  -- (0: acked without a run, its parts written before)
  local tally = {}
  observe_latency(tally, ARGV[9] .. '|chunk|' .. priority_class(redis.call('HGET', K.job, 'priority')), run_seconds)
  write_tally(K.latency_buckets, tally)
end
redis.call('HINCRBY', K.job, 'w:' .. ARGV[8], 1)
local chunks_done = redis.call('HINCRBY', K.job, 'chunks_done', 1)
redis.call('HSET', K.job, 'checkpoint_ts', ARGV[4], 'status', 'running')
if status == 'queued' then
  count_job_move(K.job, K.job_counts, status, 'running')
end
if chunks_done >= tonumber(redis.call('HGET', K.job, 'chunks_total')) then
  redis.call('HSET', K.items, ARGV[5], finalize_payload)
  ready_add(K.ready, ARGV[5], finalize_score, item_tenant(cjson.decode(finalize_payload)))
  add_queue(K.queues, K.queues_version, ARGV[9], K.ready)
  ring_doorbell(K.doorbell)
  return ACK.LAST_CHUNK
end
return ACK.RECORDED
