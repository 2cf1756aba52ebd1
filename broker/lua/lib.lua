-- lib: helpers every script in this folder may use. A Redis script cannot call another, so
-- broker/scripts.py puts this text in front of each script before registering it.

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
-- `job_lists.count_old_jobs`), so a job the counts never held moves nothing.
local function count_job_move(job_key, counts_key, old, new)
  if old == new or redis.call('HEXISTS', job_key, 'counted') == 0 then
    return
  end
  if old then
    redis.call('HINCRBY', counts_key, old, -1)
  end
  redis.call('HINCRBY', counts_key, new, 1)
end


-- `model_ref` has a queue: add it to the set of queues (`queues_key`), and move the set's version
-- (`version_key`) when it was not there, so that drain loops read the set again (`queues.QueueWatcher`).
local function add_queue(queues_key, version_key, model_ref)
  if redis.call('SADD', queues_key, model_ref) == 1 then
    redis.call('INCR', version_key)
  end
end


-- An item goes back to its ready queue (`item` its decoded payload): an online request counts as
-- waiting again (`waiting_key`, `keys.waiting_requests`), at the level it was submitted at (a PSA jump
-- or a `delay` timeout changes `level` and keeps the first in `base_level`).
local function count_waiting_again(waiting_key, item_id, item)
  if item['kind'] == 'request' then
    local factors = item['factors'] or {}
    redis.call('ZADD', waiting_key, number_or(factors['base_level'], number_or(factors['level'], 0)), item_id)
  end
end
