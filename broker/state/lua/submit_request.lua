-- submit_request: store an online request, queue it, ring the doorbell and top tickets up, in one step.
-- KEYS[1] ready       ZSET item id -> score (and its tenants' indexes beside it: lib.lua's `ready_add`)
-- KEYS[2] items       HASH item id -> payload
-- KEYS[3] queues      SET model refs with a queue
-- KEYS[4] request     HASH the request's fields, inputs and (later) outputs
-- KEYS[5] deadlines   ZSET item id -> deadline (the PSA index)
-- KEYS[6] policy      STRING the live policy JSON
-- KEYS[7] tickets     ZSET ticket id -> last seen
-- KEYS[8] ticket seq  STRING counter
-- KEYS[9] doorbell    LIST an idle drain task blocks on
-- KEYS[10] queues version STRING counter (moves when KEYS[3] gains a ref)
-- KEYS[11] waiting requests ZSET request id -> priority level (the model's requests not leased)
-- KEYS[12] request timeouts ZSET request id -> when its timeout passes
-- KEYS[13] counters  HASH running totals for /metrics ('requests_rejected_<reason>:<model ref>')
-- KEYS[14] tenant's queued ZSET request id -> when its record expires (its requests not answered yet)
-- KEYS[15] tenant's queued bytes HASH request id -> bytes of its inputs (or, once answered, of its kept
--           result), and 'total' -> their sum
-- KEYS[16] tenant's kept results ZSET entry -> when the kept result it counts in KEYS[15] expires
-- ARGV[1] model ref, ARGV[2] request id (also its item id), ARGV[3] JSON object of request fields
-- ARGV[4] score, ARGV[5] item payload JSON, ARGV[6] deadline (unix seconds) or ''
-- ARGV[7] seconds the request hash may live at most (a result nobody fetches must not stay forever)
-- ARGV[8] the policy JSON the score was computed with ('' for the defaults)
-- ARGV[9] now, ARGV[10] how many tickets should circulate
-- ARGV[11] the request's priority level, ARGV[12] most requests waiting for the model (0: no limit),
-- ARGV[13] most waiting at its level (0: no limit), ARGV[14] when its timeout passes ('' for none)
-- ARGV[15] most requests of its tenant not answered yet (0: no limit)
-- ARGV[16] most bytes of inputs its tenant's requests not answered yet may hold (0: no limit), ARGV[17] this
-- request's bytes of inputs
-- Returns: {SUBMIT.ACCEPTED, new ticket ids...}; {SUBMIT.EXISTS} when a request with that id exists
-- already; {SUBMIT.POLICY_CHANGED} when the
-- live policy is no longer ARGV[8] (nothing written: score again with the live policy and retry,
-- so no item is ever queued with the weights of a policy that a re-score has already replaced);
-- {SUBMIT.QUEUE_FULL, waiting} when the model's queue is full, {SUBMIT.LEVEL_FULL, waiting at the level}
-- when its level is, {SUBMIT.TENANT_FULL, unanswered} when its tenant has max_queued requests not answered yet (entries past their record's
-- expiry are dropped first, so a request nobody completed cannot hold a place for ever), and
-- {SUBMIT.TENANT_BYTES_FULL, bytes held, unanswered, results kept, when enough kept results will have expired
-- ('': they hold too little)} when its bytes would take its tenant past max_queued_bytes (nothing written
-- but the rejection's count: the check and the enqueue are one step, so two API processes can never both
-- take the last place). Either cap on, the request is in KEYS[14]; the bytes cap on, in KEYS[15] too;
-- `complete_requests.lua` takes it off KEYS[14] and counts its kept result in KEYS[15] instead, scheduled
-- in KEYS[16] (lib.lua's `keep_tenant_result`), which a submit of the tenant frees once expired.
-- KEYS by name (the positions above are the callers' contract).
local K = {ready = KEYS[1], items = KEYS[2], queues = KEYS[3], request = KEYS[4], deadlines = KEYS[5],
  policy = KEYS[6], tickets = KEYS[7], ticket_seq = KEYS[8], doorbell = KEYS[9], queues_version = KEYS[10],
  waiting_requests = KEYS[11], request_timeouts = KEYS[12], counters = KEYS[13], tenant_queued = KEYS[14],
  tenant_queued_bytes = KEYS[15], tenant_kept = KEYS[16]}
if (redis.call('GET', K.policy) or '') ~= ARGV[8] then
  return {SUBMIT.POLICY_CHANGED}
end
if redis.call('EXISTS', K.request) == 1 then
  return {SUBMIT.EXISTS}
end
local level, most, most_at_level = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
if most > 0 then
  local waiting = redis.call('ZCARD', K.waiting_requests)
  if waiting >= most then
    redis.call('HINCRBY', K.counters, 'requests_rejected_queue_full:' .. ARGV[1], 1)
    return {SUBMIT.QUEUE_FULL, waiting}
  end
end
if most_at_level > 0 then
  local waiting = redis.call('ZCOUNT', K.waiting_requests, level, level)
  if waiting >= most_at_level then
    redis.call('HINCRBY', K.counters, 'requests_rejected_level_full:' .. ARGV[1], 1)
    return {SUBMIT.LEVEL_FULL, waiting}
  end
end
local tenant_most, bytes_most, size = tonumber(ARGV[15]), tonumber(ARGV[16]), tonumber(ARGV[17])
if tenant_most > 0 or bytes_most > 0 then
  -- The request's place first: a write Redis refuses at maxmemory. Redis checks memory only at a
  -- script's first write of a kind that may grow it, so a first ZREM (freeing the expired) would let
  -- every write after it through a full Redis.
  redis.call('ZADD', K.tenant_queued, tonumber(ARGV[9]) + tonumber(ARGV[7]), ARGV[2])
  for _, expired in ipairs(redis.call('ZRANGEBYSCORE', K.tenant_queued, '-inf', ARGV[9])) do
    free_tenant_place(K.tenant_queued, K.tenant_queued_bytes, expired)
  end
  free_kept_results(K.tenant_queued_bytes, K.tenant_kept, ARGV[9])
  local unanswered = redis.call('ZCARD', K.tenant_queued) - 1
  if tenant_most > 0 and unanswered >= tenant_most then
    redis.call('ZREM', K.tenant_queued, ARGV[2])
    redis.call('HINCRBY', K.counters, 'requests_rejected_tenant_full:' .. ARGV[1], 1)
    return {SUBMIT.TENANT_FULL, unanswered}
  end
  if bytes_most > 0 then
    local queued_bytes = tonumber(redis.call('HGET', K.tenant_queued_bytes, QUEUED_BYTES_TOTAL) or 0)
    if queued_bytes + size > bytes_most then
      redis.call('ZREM', K.tenant_queued, ARGV[2])
      redis.call('HINCRBY', K.counters, 'requests_rejected_tenant_bytes_full:' .. ARGV[1], 1)
      return {SUBMIT.TENANT_BYTES_FULL, queued_bytes, unanswered, redis.call('ZCARD', K.tenant_kept),
        kept_free_at(K.tenant_queued_bytes, K.tenant_kept, queued_bytes + size - bytes_most) or ''}
    end
    redis.call('HSET', K.tenant_queued_bytes, ARGV[2], ARGV[17])
    redis.call('HINCRBY', K.tenant_queued_bytes, QUEUED_BYTES_TOTAL, ARGV[17])
  end
end
local flat = {}  -- (one HSET for every field: a command each would cost Redis a dispatch each)
for name, value in pairs(cjson.decode(ARGV[3])) do
  flat[#flat + 1] = name
  flat[#flat + 1] = tostring(value)
end
redis.call('HSET', K.request, unpack(flat))
redis.call('EXPIRE', K.request, ARGV[7])
redis.call('HSET', K.items, ARGV[2], ARGV[5])
ready_add(K.ready, ARGV[2], ARGV[4], item_tenant(cjson.decode(ARGV[5])))
redis.call('ZADD', K.waiting_requests, level, ARGV[2])
announce_waiting(K.waiting_requests)
if ARGV[14] ~= '' then
  redis.call('ZADD', K.request_timeouts, ARGV[14], ARGV[2])
end
if ARGV[6] ~= '' then
  redis.call('ZADD', K.deadlines, ARGV[6], ARGV[2])
end
add_queue(K.queues, K.queues_version, ARGV[1], K.ready)
-- What top_up_tickets.lua does, here too, so that a submit is one round trip.
ring_doorbell(K.doorbell)
local out = {SUBMIT.ACCEPTED}
for _, ticket in ipairs(top_up_tickets(K.tickets, K.ticket_seq, ARGV[9], tonumber(ARGV[10]))) do
  out[#out + 1] = ticket
end
return out
