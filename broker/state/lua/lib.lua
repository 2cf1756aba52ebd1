-- lib: helpers every script in this folder may use. A Redis script cannot call another, so
-- broker/state/scripts.py puts this text in front of each script before registering it.

-- JSON null decodes to cjson.null, not nil: count anything that is not a number as `default`.
local function number_or(value, default)
  if type(value) == 'number' then
    return value
  end
  return default
end

-- Is `ticket` still valid (or is there none, '')? A valid one is marked seen at `now`. A stale
-- copy of a replaced ticket is not: its caller returns {-1}.
local function ticket_valid(tickets_key, ticket, now)
  if ticket == '' then
    return true
  end
  if not redis.call('ZSCORE', tickets_key, ticket) then
    return false
  end
  redis.call('ZADD', tickets_key, 'XX', now, ticket)
  return true
end

-- Wake an idle drain task (it blocks on this list); the list is kept short.
local function ring_doorbell(doorbell_key)
  redis.call('LPUSH', doorbell_key, '1')
  redis.call('LTRIM', doorbell_key, 0, 63)
end

-- Append a leased item to a lease script's reply: its id, payload, lease count, and, for an online
-- request (`req`, its id), its packed inputs read from its hash (`request_prefix` .. req), so that the
-- worker needs no second round trip before the run; '' for a job chunk or finalize step, for a
-- request whose hash has expired, and with no `request_prefix` ('': not read).
local function append_leased(out, item_id, payload, attempts, request_prefix, req)
  out[#out + 1] = item_id
  out[#out + 1] = payload
  out[#out + 1] = attempts
  local inputs = ''
  if request_prefix ~= '' and type(req) == 'string' and req ~= '' then
    inputs = redis.call('HGET', request_prefix .. req, 'inputs') or ''
  end
  out[#out + 1] = inputs
end

-- Create batch tickets until `target` circulate; returns the new ids (each is sent as a drain task).
local function top_up_tickets(tickets_key, seq_key, now, target)
  local new = {}
  local count = redis.call('ZCARD', tickets_key)
  while count < target do
    local ticket = 't' .. redis.call('INCR', seq_key)
    redis.call('ZADD', tickets_key, now, ticket)
    new[#new + 1] = ticket
    count = count + 1
  end
  return new
end


-- A job goes from status `old` (false: a new job) to `new`: keep the per-status job counts
-- (`counts_key`, HASH status -> jobs) right. Only jobs whose hash has 'counted' are in those counts
-- (every job created since they exist; older ones once a reaper pass counted them,
-- `broker.jobs.lists.count_old_jobs`), so a job the counts never held moves nothing.
local function count_job_move(job_key, counts_key, old, new)
  if old == new or redis.call('HEXISTS', job_key, 'counted') == 0 then
    return
  end
  if old then
    redis.call('HINCRBY', counts_key, old, -1)
  end
  redis.call('HINCRBY', counts_key, new, 1)
end


-- Tenant indexes (`keys.ready_of_tenant`): beside each ready ZSET, one ZSET per tenant ('' for none) of its
-- waiting items at the same scores, where a fair-share lease finds a ranked tenant's work (lease_batch.lua).
-- Named from the ready key, so scripts keep them through these helpers with no KEYS of their own. The `built`
-- mark: the index holds every waiting item (`add_queue`; a queue stored before the indexes, index_ready.lua).
local TENANT_INDEX_SEPARATOR = '|'
local TENANT_INDEX_BUILT = '#by-tenant-built'
local TENANT_INDEX_CURSOR = '#by-tenant-cursor'

-- The tenant an item (its decoded payload) is indexed under: its `tenant`, '' for none.
local function item_tenant(item)
  local tenant = item and item['tenant']
  return type(tenant) == 'string' and tenant or ''
end

-- The name of `tenant`'s index beside the ready ZSET `ready_key`.
local function tenant_index(ready_key, tenant)
  return ready_key .. TENANT_INDEX_SEPARATOR .. (type(tenant) == 'string' and tenant or '')
end

-- Does `ready_key`'s tenant index hold every waiting item (its `built` mark)?
local function tenant_index_built(ready_key)
  return redis.call('EXISTS', ready_key .. TENANT_INDEX_BUILT) == 1
end

-- Queue (or re-score) `item_id` at `score` in `ready_key` and in its tenant's index.
local function ready_add(ready_key, item_id, score, tenant)
  redis.call('ZADD', ready_key, score, item_id)
  redis.call('ZADD', tenant_index(ready_key, tenant), score, item_id)
end

-- Take `item_id`, of `tenant`, out of `ready_key` and its tenant's index; true when it was waiting.
local function ready_remove(ready_key, item_id, tenant)
  if redis.call('ZREM', ready_key, item_id) == 0 then
    return false
  end
  redis.call('ZREM', tenant_index(ready_key, tenant), item_id)
  return true
end

-- `ready_remove` for an item whose tenant the caller does not know: read from its payload in `items_key`
-- (before the payload goes), only when it was waiting.
local function ready_remove_stored(ready_key, items_key, item_id)
  if redis.call('ZREM', ready_key, item_id) == 0 then
    return false
  end
  local payload = redis.call('HGET', items_key, item_id)
  redis.call('ZREM', tenant_index(ready_key, item_tenant(payload and cjson.decode(payload))), item_id)
  return true
end


-- `model_ref` has a queue: add it to the set of queues (`queues_key`), and move the set's version
-- (`version_key`) when it was not there, so that drain loops read the set again (`queues.QueueWatcher`).
-- A ref new to the set had nothing waiting before this call (a queue leaves the set only empty,
-- prune_queue.lua), so all that waits in `ready_key` now came through `ready_add`: its tenant index is built.
local function add_queue(queues_key, version_key, model_ref, ready_key)
  if redis.call('SADD', queues_key, model_ref) == 1 then
    redis.call('INCR', version_key)
    redis.call('SET', ready_key .. TENANT_INDEX_BUILT, '1')
  end
end


-- An online request waits in the queue of `waiting_key`'s model: a publish on that key's name (a
-- channel, not a key) tells the running job chunks to look (`sits_worker/serving/request_bell.py`).
local function announce_waiting(waiting_key)
  redis.call('PUBLISH', waiting_key, '1')
end


-- An item goes back to its ready queue (`item` its decoded payload): an online request counts as
-- waiting again (`waiting_key`, `keys.waiting_requests`), at the level it was submitted at (a PSA jump
-- or a `delay` timeout changes `level` and keeps the first in `base_level`), and is announced.
local function count_waiting_again(waiting_key, item_id, item)
  if item['kind'] == 'request' then
    local factors = item['factors'] or {}
    redis.call('ZADD', waiting_key, number_or(factors['base_level'], number_or(factors['level'], 0)), item_id)
    announce_waiting(waiting_key)
  end
end


-- The field of a tenant's bytes HASH (`keys.tenant_queued_bytes`) that holds the sum of its entries.
local QUEUED_BYTES_TOTAL = 'total'

-- Take `entry` off a tenant's bytes HASH (`bytes_key`), its total with it; nothing when it is not there, so a
-- second call frees nothing. A HASH left with its total alone goes, total and all, so the total never
-- outlives the entries it sums.
local function drop_tenant_bytes(bytes_key, entry)
  local size = redis.call('HGET', bytes_key, entry)
  if not size then
    return
  end
  redis.call('HDEL', bytes_key, entry)
  if redis.call('HLEN', bytes_key) <= 1 then
    redis.call('DEL', bytes_key)
  else
    redis.call('HINCRBY', bytes_key, QUEUED_BYTES_TOTAL, -tonumber(size))
  end
end

-- Give back what an online request held of its tenant's caps: its place among the requests not answered
-- (`queued_key`, `max_queued`) and its bytes (`bytes_key`, `max_queued_bytes`). Only what is still held is
-- freed, so a second call frees nothing.
local function free_tenant_place(queued_key, bytes_key, item_id)
  redis.call('ZREM', queued_key, item_id)
  drop_tenant_bytes(bytes_key, item_id)
end

-- A request answered, its result stored: its place among the requests not answered goes (`queued_key`), and,
-- where its tenant's `max_queued_bytes` counted its inputs (its entry in `bytes_key`), its bytes now count
-- what Redis keeps of its answer instead, until that goes: `kept` lists {entry, bytes, until} (its hash under
-- its own id; a copy pushed to its waiter's inbox under another), each scheduled in `kept_key` (ZSET entry ->
-- until) and freed by the tenant's next submit after then (`free_kept_results`).
local function keep_tenant_result(queued_key, bytes_key, kept_key, item_id, kept)
  redis.call('ZREM', queued_key, item_id)
  local counted = tonumber(redis.call('HGET', bytes_key, item_id))
  if not counted then
    return
  end
  local change = 0
  for _, entry in ipairs(kept) do
    local old = tonumber(redis.call('HGET', bytes_key, entry[1])) or 0
    redis.call('HSET', bytes_key, entry[1], entry[2])
    redis.call('ZADD', kept_key, entry[3], entry[1])
    change = change + entry[2] - old
  end
  redis.call('HINCRBY', bytes_key, QUEUED_BYTES_TOTAL, change)
end

-- Most kept results one call frees (`free_kept_results`): a call stays short; the next submit frees more.
local KEPT_FREE_MOST = 1000

-- Free the tenant's kept results (`kept_key`, `bytes_key`) whose keep time passed by `now`.
local function free_kept_results(bytes_key, kept_key, now)
  for _, entry in ipairs(redis.call('ZRANGEBYSCORE', kept_key, '-inf', now, 'LIMIT', 0, KEPT_FREE_MOST)) do
    redis.call('ZREM', kept_key, entry)
    drop_tenant_bytes(bytes_key, entry)
  end
end

-- Most kept results `kept_free_at` looks at.
local KEPT_WALK_MOST = 256

-- When the tenant's kept results, going in the order they expire, will have freed `need` bytes; nil when the
-- first KEPT_WALK_MOST of them hold less (the requests not answered must free the rest).
local function kept_free_at(bytes_key, kept_key, need)
  local freed = 0
  local walk = redis.call('ZRANGE', kept_key, 0, KEPT_WALK_MOST - 1, 'WITHSCORES')
  for index = 1, #walk, 2 do
    freed = freed + (tonumber(redis.call('HGET', bytes_key, walk[index])) or 0)
    if freed >= need then
      return walk[index + 1]
    end
  end
  return nil
end


-- Upper bounds, in seconds, of the latency histograms' buckets; `broker.monitoring.sla_metrics.LATENCY_BUCKETS`
-- lists the same. Bucket i (1-based) counts observations above bound i-1 and up to bound i;
-- #LATENCY_BUCKETS + 1 counts those past the last.
local LATENCY_BUCKETS = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}

-- The priority class of a level as submitted (`broker.monitoring.sla_metrics.PRIORITY_CLASSES`).
local function priority_class(level)
  level = tonumber(level) or 0
  if level >= 12 then
    return 'express'
  elseif level >= 8 then
    return 'high'
  elseif level >= 4 then
    return 'normal'
  end
  return 'low'
end

-- Count one observation of `seconds` into `tally` (field -> increment) for the histogram `series`
-- ('<model ref>|<what>|<class>'): its bucket's field, and the series' sum in nanoseconds ('|ns').
local function observe_latency(tally, series, seconds)
  seconds = math.max(seconds, 0)
  local bucket = #LATENCY_BUCKETS + 1
  for i = 1, #LATENCY_BUCKETS do
    if seconds <= LATENCY_BUCKETS[i] then
      bucket = i
      break
    end
  end
  local field = series .. '|' .. bucket
  tally[field] = (tally[field] or 0) + 1
  tally[series .. '|ns'] = (tally[series .. '|ns'] or 0) + seconds * 1e9
end

-- Add a tally to its HASH (`keys.latency_buckets`): one HINCRBY a field, however many observations.
local function write_tally(hash_key, tally)
  for field, total in pairs(tally) do
    redis.call('HINCRBY', hash_key, field, string.format('%.0f', total))
  end
end

-- A job moved from `old` to the final status `new` at `now`: it leaves the index of active jobs with a
-- deadline (`due_key`, `keys.jobs_due`), and /metrics counts its end (`broker.monitoring.sla_metrics`). A job that
-- succeeded adds its time from submit to finish to its latency histogram (`buckets_key`). A job with a
-- deadline counts as met (it succeeded by then) or missed (it failed, or succeeded late) in `counters_key`;
-- a cancelled one counts neither way. Only a move from an active status counts: a finalize step that
-- replaces a stop counts nothing again, and a resumed job counts again when it ends again.
local function count_job_end(job_key, job_id, old, new, now, counters_key, buckets_key, due_key)
  redis.call('ZREM', due_key, job_id)
  if old ~= 'queued' and old ~= 'running' then
    return
  end
  local model_ref, level, created, deadline = unpack(redis.call('HMGET', job_key, 'model_ref', 'priority',
    'created_at', 'deadline'))
  if not model_ref then
    return
  end
  if new == 'succeeded' then
    local tally = {}
    observe_latency(tally, model_ref .. '|job|' .. priority_class(level), now - (tonumber(created) or now))
    write_tally(buckets_key, tally)
  end
  deadline = tonumber(deadline)
  if deadline and new ~= 'cancelled' then
    local outcome = (new == 'succeeded' and now <= deadline) and 'met' or 'missed'
    redis.call('HINCRBY', counters_key, 'job_deadline_' .. outcome .. ':' .. model_ref, 1)
  end
end

-- Record one failure of item `item_id` in the class `class` on its record (`record_key`: its job's or
-- request's HASH; nothing when that is gone): the class's attempts, last error and time, the job's
-- `last_error`, and an entry in `failures`, the record's last FAILURE_LOG_LENGTH failures (JSON).
-- `retry_at` is when the item runs again (nil: it does not). `counted`: the attempts field was
-- counted already (a request's own count is its class's).
local FAILURE_LOG_LENGTH = 20
local function note_failure(record_key, item_id, class, error, now, retry_at, counted)
  if redis.call('EXISTS', record_key) == 0 then
    return
  end
  if not counted then
    redis.call('HINCRBY', record_key, 'attempts:' .. class, 1)
  end
  redis.call('HSET', record_key, 'error:' .. class, error, 'failed_at:' .. class, now, 'last_error', error)
  local log = cjson.decode(redis.call('HGET', record_key, 'failures') or '[]')
  log[#log + 1] = {class = class, item = item_id, at = now, retry_at = retry_at or cjson.null}
  while #log > FAILURE_LOG_LENGTH do
    table.remove(log, 1)
  end
  redis.call('HSET', record_key, 'failures', cjson.encode(log))
end

-- A fair-share `tenants` option ({order, held}) as lookups: tenant -> its rank in `order`, the set of
-- held tenants, and the rank of every tenant not in `order` (after the last ranked one).
local function tenant_ranks(tenants)
  local rank, held = {}, {}
  for index, name in ipairs(tenants.order or {}) do
    rank[name] = index
  end
  for _, name in ipairs(tenants.held or {}) do
    held[name] = true
  end
  return rank, held, #(tenants.order or {}) + 1
end

-- How long a model's served-tenants HASH (`keys.tenants_served`) outlives its last write.
local SERVED_KEEP_SECONDS = 3600
-- The field of that HASH, after a tenant's name, that holds a lease's mark apart from the answers' (the
-- tenant's own field): an answer without a run takes the lease's mark back and leaves the answers' standing.
local SERVED_LEASED = '|leased'

-- The leased requests' tenants (`tenants`, tenant -> true) are present on the model while their batch runs
-- (`shares`: the lease's option): marked leased until `in_flight_for` seconds from `now`. Their answer takes
-- that mark back (`mark_answered`), so only requests never answered (a worker died) keep them present that
-- long, plus `present_for`.
local function mark_leased(served_key, tenants, now, shares)
  local fields = {}
  local at = tonumber(now) + math.max(number_or(shares.in_flight_for, 0), 0)
  for tenant in pairs(tenants) do
    fields[#fields + 1] = tenant .. SERVED_LEASED
    fields[#fields + 1] = string.format('%.6f', at)
  end
  if #fields > 0 then
    redis.call('HSET', served_key, unpack(fields))
    redis.call('EXPIRE', served_key, SERVED_KEEP_SECONDS)
  end
end

-- A completion's marks on the model's served HASH: the tenants of `ran` (tenant -> true), whose requests
-- were in the run, are marked answered at `now`; those of `unrun`, whose requests in the call none ran
-- (expired, past their timeout, their worker died), get no mark, so a request answered without a run never
-- keeps its tenant present. Both lose their lease's mark: the first answer ends the presence a second batch
-- of the tenant gave, and the tenant then counts by its next requests (`broker/tenants/batch_shares.py`).
local function mark_answered(served_key, ran, unrun, now)
  local marks, leased = {}, {}
  for tenant in pairs(ran) do
    marks[#marks + 1] = tenant
    marks[#marks + 1] = now
    leased[#leased + 1] = tenant .. SERVED_LEASED
  end
  for tenant in pairs(unrun) do
    if not ran[tenant] then
      leased[#leased + 1] = tenant .. SERVED_LEASED
    end
  end
  if #leased > 0 then
    redis.call('HDEL', served_key, unpack(leased))
  end
  if #marks > 0 then
    redis.call('HSET', served_key, unpack(marks))
    redis.call('EXPIRE', served_key, SERVED_KEEP_SECONDS)
  end
end

-- When each ranked tenant of `shares` (a lease's `shares` option) was last served on the model (`served_key`,
-- `keys.tenants_served`): tenant -> the later of its last answer that ran and its lease's mark, one HMGET.
local function served_times(served_key, shares)
  local times, fields = {}, {}
  for _, entry in ipairs(shares.ranked or {}) do
    fields[#fields + 1] = entry.tenant
    fields[#fields + 1] = entry.tenant .. SERVED_LEASED
  end
  if #fields > 0 then
    local values = redis.call('HMGET', served_key, unpack(fields))
    for index = 1, #fields, 2 do
      local answered, leased = tonumber(values[index]), tonumber(values[index + 1])
      times[fields[index]] = (answered and leased) and math.max(answered, leased) or answered or leased
    end
  end
  return times
end

-- Is `item` (a decoded payload) an online request whose `reject` timeout (`expires_at`) has passed by `now`?
-- A lease neither takes nor counts such a request: it waits for its failure (expire_requests.lua), and no
-- tenant is present on a model, or leads its share split, by requests that will never run.
local function request_expired(item, now)
  local expires = item and item['expires_at']
  return type(expires) == 'number' and expires <= tonumber(now)
end

-- Tenants' shares inside one merged batch; `broker/tenants/batch_shares.py` (`split_batch`) is the reference
-- and says why. `shares` is the lease's `shares` option ({ranked [{tenant, share}], present_for, in_flight_for});
-- `waiting` tenant -> items waiting within the lease's reach; `served_at` tenant -> when its requests of the
-- model were last answered, or the end of its leased batch's run bound (`mark_leased`: in the future while
-- it runs). The anchor is the first ranked tenant present on the model (work waiting, or served within
-- present_for). Returns the anchor (nil: none), its share, and how many are present.
local function share_anchor(shares, waiting, served_at, now)
  local anchor, anchor_share, present = nil, nil, 0
  for _, entry in ipairs(shares.ranked or {}) do
    local served = served_at[entry.tenant]
    if (waiting[entry.tenant] or 0) > 0 or (served ~= nil and now - served < shares.present_for) then
      present = present + 1
      if anchor == nil then
        anchor, anchor_share = entry.tenant, entry.share
      end
    end
  end
  return anchor, anchor_share, present
end

-- The split of a batch headed by a request of `head_tenant`, whose rows in the head's bucket are
-- `anchor_rows`: nil (no caps: fewer than two present, or the anchor does not head), or {anchor, quotas
-- (tenant -> most rows), hold}.
local function share_split(shares, waiting, served_at, head_tenant, anchor_rows, now)
  local anchor, anchor_share, present = share_anchor(shares, waiting, served_at, now)
  if present < 2 then
    return nil
  end
  if (waiting[anchor] or 0) <= 0 then
    return {anchor = anchor, quotas = {}, hold = true}
  end
  if anchor ~= head_tenant then
    return nil
  end
  local quotas = {}
  for _, entry in ipairs(shares.ranked) do
    if entry.tenant ~= anchor then
      quotas[entry.tenant] = math.floor(anchor_rows * entry.share / anchor_share + 1e-9)
    end
  end
  return {anchor = anchor, quotas = quotas, hold = false}
end

-- The most rows `tenant` may add to a batch under a share split (nil: no cap; a tenant without a share: 0).
local function share_quota(split, tenant)
  if split == nil or tenant == split.anchor then
    return nil
  end
  return split.hold and 0 or (split.quotas[tenant] or 0)
end

-- A job's slot cap (payload `max_slots`, set by the job or its schedule's plan): the most of its chunks
-- leased at once. Its leased chunk ids are kept beside the model's in-flight set (same hash tag); an
-- entry counts only while that chunk is still in flight, so no script that ends a lease needs to know.
local JOB_SLOTS_SEPARATOR = '|slots|'
local JOB_SLOTS_KEEP_SECONDS = 86400

local function job_slots_key(inflight_key, job)
  return inflight_key .. JOB_SLOTS_SEPARATOR .. job
end

-- How many of `job`'s chunks are in flight now (entries of chunks no longer in flight are dropped).
local function job_slots_held(inflight_key, job)
  local key = job_slots_key(inflight_key, job)
  local held = 0
  for _, item_id in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    if redis.call('ZSCORE', inflight_key, item_id) then
      held = held + 1
    else
      redis.call('ZREM', key, item_id)
    end
  end
  return held
end

-- Count chunk `item_id` of `job` as holding one of its slots until it leaves the in-flight set.
local function note_job_slot(inflight_key, job, item_id, lease_deadline)
  local key = job_slots_key(inflight_key, job)
  redis.call('ZADD', key, lease_deadline, item_id)
  redis.call('EXPIRE', key, JOB_SLOTS_KEEP_SECONDS)
end

-- The slot cap of a chunk's job (its payload's `max_slots`), or nil for an uncapped item.
local function chunk_slot_cap(item)
  if item['kind'] ~= 'chunk' or type(item['max_slots']) ~= 'number' or item['max_slots'] < 1 then
    return nil
  end
  return item['max_slots']
end

-- The ready-queue score of an item from its payload's factors `f` under the policy `w` ({ordering, alpha, beta,
-- gamma, delta, express_level, express_max_tokens, express_bonus}): exactly what broker/queueing/scoring.py
-- queue_key computes (rescore.lua, re_estimate.lua; a test compares the two).
local SCORE_EPOCH = 1704067200.0
local function queue_key(f, w)
  if w.ordering == 'fifo' then
    return number_or(f['enqueued_at'], 0) - SCORE_EPOCH
  end
  local enqueued_at = number_or(f['enqueued_at'], 0)
  local since = number_or(f['order_at'], enqueued_at)
  local level = number_or(f['level'], 0)
  local max_level = number_or(f['max_level'], 15)
  if type(f['order_at']) == 'number' and max_level < 15 and w.delta > 0 then
    -- a capped item's deadline gains it at most its cap's points (scoring.py aging_since, deadline_reach)
    since = math.max(since, enqueued_at - math.max(max_level - level, 0) / w.delta)
  end
  since = since - SCORE_EPOCH
  local latency_points = 0
  local latency = f['est_latency_ms']
  if type(latency) == 'number' then
    latency_points = math.min(100.0 / math.max(latency, 0.001), 10.0)
  end
  local points = level + w.alpha * latency_points + w.beta * number_or(f['sla_weight'], 1.0)
    + w.gamma * number_or(f['complexity'], 0.0)
  local key = w.delta * since - points
  local tokens = f['tokens']
  -- (a short request takes the express lane only for a tenant that may ask its level: scoring.py is_express)
  if level >= w.express_level
      or (type(tokens) == 'number' and tokens < w.express_max_tokens and max_level >= w.express_level) then
    key = key - w.express_bonus
  end
  return key
end

-- The policy table `queue_key` takes, from the ordering and the seven weights at ARGV[first..first + 6]
-- (alpha, beta, gamma, delta, express_level, express_max_tokens, express_bonus).
local function score_weights(ordering, first)
  return {ordering = ordering, alpha = tonumber(ARGV[first]), beta = tonumber(ARGV[first + 1]),
    gamma = tonumber(ARGV[first + 2]), delta = tonumber(ARGV[first + 3]), express_level = tonumber(ARGV[first + 4]),
    express_max_tokens = tonumber(ARGV[first + 5]), express_bonus = tonumber(ARGV[first + 6])}
end
