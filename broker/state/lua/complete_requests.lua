-- complete_requests: store the results of a merged batch of online requests and wake their waiters.
-- KEYS[1] inflight   ZSET
-- KEYS[2] items      HASH
-- KEYS[3] attempts   HASH
-- KEYS[4] deadlines  ZSET
-- KEYS[5] ready      ZSET
-- KEYS[6] counters   HASH running totals for /metrics: 'requests_<status>:<model ref>' counts the
--           requests completed here, by status: succeeded, failed, or expired (its hash was gone, so
--           no result could be stored); one HINCRBY a status present in the call; and 'request_deadline_<met|missed>:<model ref>'
--           those with a deadline (`deadline_ms`): met when answered by it, else missed (failed, or late)
-- KEYS[7] model stats HASH '<model ref>|<stat>' -> running total, for the v2 statistics extension
--           (`broker.monitoring.model_stats`): requests succeeded and failed (count, ns from submit to result),
--           the queue and compute time of those that ran, rows inferred, runs
-- KEYS[8] model batch stats HASH '<model ref>|<rows>_count' / '..._ns' -> runs of that many rows and their
--           time (apart from KEYS[7], which a /metrics scrape reads whole: these grow with the sizes run)
-- KEYS[9] latency buckets HASH the latency histograms of online requests by model and priority class
--           (`broker.monitoring.sla_metrics`): submit to result of those answered, submit to run start and the
--           run (its start to this call) of those that ran
-- KEYS[10] served  HASH tenant -> when its requests of the model were last answered (or leased): each tenant
--           with a request in the run is marked now, and every tenant of a request this call takes off its
--           lease loses its lease's mark (lib.lua's `mark_answered`: an answer without a run marks nothing;
--           a lease's share split, `broker/tenants/batch_shares.py`)
-- KEYS[11..] for each request in order: its HASH, then the inbox LIST of the API process that waits for
--           it, where the finished request's fields go as one JSON object (with its id), so the waiter
--           needs no second read; its HASH again when nobody waits (its result then stays in the HASH alone);
--           then its tenant's queued ZSET, queued bytes HASH and kept results ZSET (`max_queued`,
--           `max_queued_bytes`): a request this call takes off its lease leaves the first, and its bytes
--           count its stored result, and its inbox copy, until each expires (lib.lua's `keep_tenant_result`)
-- ARGV[1] now, ARGV[2] seconds results are kept, ARGV[3] size of the batch (requests, plus job rows
-- when it shared a run with a job), ARGV[4] worker, ARGV[5] rows of offline jobs that shared the run,
-- ARGV[6] the requests' model ref (a batch is of one model), ARGV[7] when the run began ('' for none:
-- the reaper failing requests whose workers died), ARGV[8] rows in the run (the requests' that ran, and
-- a job mini-batch's it shared; the statistics' batch size, as Triton counts it), ARGV[9] seconds an inbox
-- copy is kept (at most ARGV[2]: a live waiter pops it at once)
-- ARGV[10..] for each request: item id, status ('succeeded' | 'failed'), outputs JSON, error text, error
-- code, '1' if it was in the run ('' for one not run: expired, or past its timeout), its priority level
-- as submitted (its histograms' class)
-- Returns: {how many requests were completed, then the 0-based position of each request this call took off
-- its lease (completed, or its hash expired)}: only those are settled with their tenants (freed here, and
-- billed by the caller when failed); a request that succeeded but whose result was refused for its tenant's
-- bytes (`result_refusal`) is at -1 - its position.
-- A request gets one result: one that is waiting again (its lease expired and the reaper put it
-- back: it will run again) or already completed (no payload left) is skipped, so a late or
-- repeated completion from a worker that lost its lease changes nothing.
-- A succeeded request whose outputs would take its tenant's bytes past the budget its submit stored
-- (`bytes_budget`: its `max_queued_bytes`) fails instead, its outputs not kept (`result_refusal`).
-- KEYS by name (the positions above are the callers' contract).
local K = {inflight = KEYS[1], items = KEYS[2], attempts = KEYS[3], deadlines = KEYS[4], ready = KEYS[5],
  counters = KEYS[6], model_stats = KEYS[7], model_batch_stats = KEYS[8], latency_buckets = KEYS[9],
  served = KEYS[10]}
local KEYS_EACH, ARGS_EACH = 5, 7  -- (KEYS and ARGV per request)

-- What a finished request's hash holds once written: its fields by name, the bytes of its fields and values,
-- and its waiter's inbox copy (nil when nobody waits).
local function kept_fields(request, copied)
  local flat, fields, stored = redis.call('HGETALL', request), {}, 0
  for j = 1, #flat, 2 do
    fields[flat[j]] = flat[j + 1]
    stored = stored + #flat[j] + #flat[j + 1]
  end
  return fields, stored, copied and cjson.encode(fields) or nil
end

-- Why a request's result (`kept` bytes: its hash, and its inbox copy) may not be kept: {message, error code}
-- when it would take its tenant's bytes (`bytes_key`) past `budget` (what its submit stored in
-- `bytes_budget`, 0: none), less what its inputs counted; nil when it fits. Inputs are bounded at submit,
-- but outputs can be far larger (a sequence model's S x S scores).
local function result_refusal(budget, bytes_key, item_id, kept)
  if budget <= 0 then
    return nil
  end
  local held = (tonumber(redis.call('HGET', bytes_key, QUEUED_BYTES_TOTAL)) or 0)
    - (tonumber(redis.call('HGET', bytes_key, item_id)) or 0)
  if held + kept <= budget then
    return nil
  end
  if kept > budget then
    return {'its outputs take ' .. kept .. ' bytes to keep, more than its tenant may hold at all (' .. budget
      .. ' bytes, tenants.<name>.max_queued_bytes); send fewer rows or tokens a request', 'payload_too_large'}
  end
  return {'its outputs take ' .. kept .. ' bytes to keep, and its tenant holds ' .. held .. ' of its ' .. budget
    .. ' (tenants.<name>.max_queued_bytes) in requests not answered and results not expired; retry once '
    .. 'those are read or expire', 'queue_full'}
end
local done, by_status, deadlines = 0, {}, {}
local reply = {0}  -- (the count goes first once known; a table, as a batch may pass unpack's limit)
local now, run_started = tonumber(ARGV[1]), tonumber(ARGV[7])
local latency = {}  -- the histograms' increments, written once for the batch
local served, unrun = {}, {}  -- tenant -> true, of the requests that ran; of those taken off and not run
local inbox_keep = math.min(tonumber(ARGV[9]), tonumber(ARGV[2]))
local stats = {success_count = 0, success_ns = 0, fail_count = 0, fail_ns = 0, queue_count = 0, queue_ns = 0,
               infer_count = 0, infer_ns = 0, inference_count = 0}
for i = 0, (#ARGV - 9) / ARGS_EACH - 1 do
  local a, k = 10 + ARGS_EACH * i, 11 + KEYS_EACH * i  -- (this request's first ARGV and KEYS)
  local item_id, status = ARGV[a], ARGV[a + 1]
  local request, waiters = KEYS[k], KEYS[k + 1]
  local queued, queued_bytes, kept = KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local payload = redis.call('HGET', K.items, item_id)
  local held = payload and not redis.call('ZSCORE', K.ready, item_id)
  if held then
    reply[#reply + 1] = i
    redis.call('ZREM', K.inflight, item_id)
    redis.call('HDEL', K.items, item_id)
    redis.call('HDEL', K.attempts, item_id)
    redis.call('ZREM', K.deadlines, item_id)
  end
  local ran = held and run_started and ARGV[a + 5] == '1'
  if held and not ran then
    unrun[item_tenant(cjson.decode(payload))] = true
  end
  if held and redis.call('EXISTS', request) == 1 then
    local budget = tonumber(redis.call('HGET', request, 'bytes_budget') or '') or 0
    redis.call('HSET', request, 'status', status, 'outputs', ARGV[a + 2], 'error', ARGV[a + 3],
      'error_code', ARGV[a + 4], 'finished_at', ARGV[1], 'batch_size', ARGV[3], 'worker', ARGV[4],
      'job_rows', ARGV[5], unpack(ran and {'started_at', ARGV[7]} or {}))  -- (started_at: when its run
      -- began, so its queue time ends; only for one that ran)
    redis.call('HDEL', request, 'inputs', 'bytes_budget')
    redis.call('EXPIRE', request, ARGV[2])
    local fields, stored, copy = kept_fields(request, waiters ~= request)
    local refusal = status == 'succeeded' and result_refusal(budget, queued_bytes, item_id, stored + #(copy or ''))
    if refusal then  -- its outputs would take its tenant past its byte budget: it fails, and they are not kept
      status = 'failed'
      redis.call('HSET', request, 'status', status, 'outputs', '{}', 'error', refusal[1], 'error_code', refusal[2])
      fields, stored, copy = kept_fields(request, waiters ~= request)
      reply[#reply] = -1 - i  -- (its caller bills it as failed)
    end
    local results = {{item_id, stored, now + tonumber(ARGV[2])}}  -- (what its tenant's bytes now count)
    if copy then
      redis.call('RPUSH', waiters, copy)
      redis.call('EXPIRE', waiters, math.ceil(inbox_keep))
      results[2] = {item_id .. '|inbox', #copy, now + inbox_keep}
    end
    keep_tenant_result(queued, queued_bytes, kept, item_id, results)
    done = done + 1
    by_status[status] = (by_status[status] or 0) + 1
    local due = tonumber(fields['deadline_at'])
    if due then
      local outcome = (status == 'succeeded' and now <= due) and 'met' or 'missed'
      deadlines[outcome] = (deadlines[outcome] or 0) + 1
    end
    local created = tonumber(fields['created_at']) or now
    local outcome = status == 'succeeded' and 'success' or 'fail'
    stats[outcome .. '_count'] = stats[outcome .. '_count'] + 1
    stats[outcome .. '_ns'] = stats[outcome .. '_ns'] + (now - created) * 1e9
    local class = priority_class(ARGV[a + 6])
    observe_latency(latency, ARGV[6] .. '|request|' .. class, now - created)
    if ran then
      served[fields['tenant'] or ''] = true
      observe_latency(latency, ARGV[6] .. '|queue|' .. class, run_started - created)
      observe_latency(latency, ARGV[6] .. '|run|' .. class, now - run_started)
      stats['queue_count'] = stats['queue_count'] + 1
      stats['queue_ns'] = stats['queue_ns'] + math.max(run_started - created, 0) * 1e9
      stats['infer_count'] = stats['infer_count'] + 1
      stats['infer_ns'] = stats['infer_ns'] + (now - run_started) * 1e9
    end
    if status == 'succeeded' then
      stats['inference_count'] = stats['inference_count'] + (tonumber(fields['rows']) or 1)
    end
  elseif held then  -- its hash expired before it ran (result_ttl): no one can read a result any more
    free_tenant_place(queued, queued_bytes, item_id)
    by_status['expired'] = (by_status['expired'] or 0) + 1
  end
end
for status, count in pairs(by_status) do
  redis.call('HINCRBY', K.counters, 'requests_' .. status .. ':' .. ARGV[6], count)
end
for outcome, count in pairs(deadlines) do
  redis.call('HINCRBY', K.counters, 'request_deadline_' .. outcome .. ':' .. ARGV[6], count)
end
if done > 0 then
  local prefix = ARGV[6] .. '|'
  for stat, total in pairs(stats) do
    if total > 0 then
      redis.call('HINCRBY', K.model_stats, prefix .. stat, string.format('%.0f', total))  -- (a number argument would
      -- be written with 14 digits, 1e+15 past them, which HINCRBY refuses)
    end
  end
  if run_started and stats['infer_count'] > 0 then
    local run_ns = string.format('%.0f', (now - run_started) * 1e9)
    redis.call('HINCRBY', K.model_stats, prefix .. 'execution_count', 1)
    redis.call('HINCRBY', K.model_batch_stats, prefix .. ARGV[8] .. '_count', 1)
    redis.call('HINCRBY', K.model_batch_stats, prefix .. ARGV[8] .. '_ns', run_ns)
    redis.call('HSET', K.model_stats, prefix .. 'last_inference', string.format('%.0f', now * 1000))
  end
  write_tally(K.latency_buckets, latency)
end
mark_answered(K.served, served, unrun, ARGV[1])
reply[1] = done
return reply
