-- lease_riders: lease online requests of one shape bucket from near the front of a model's queue,
-- to ride along in the next mini-batch of a job chunk of that model (one inference run for both).
-- Unlike lease_batch, the head need not be a request: requests queued behind job chunks are found
-- too, within the first ARGV[8] entries (a bounded scan, so the call stays short; while few requests
-- wait, only their entries are read).
-- KEYS[1] tickets   ZSET ticket id -> last seen
-- KEYS[2] ready     ZSET item id -> score
-- KEYS[3] inflight  ZSET item id -> lease deadline
-- KEYS[4] items     HASH item id -> payload
-- KEYS[5] attempts  HASH item id -> lease count
-- KEYS[6] waiting requests ZSET the model's online requests not leased (leased ones leave it)
-- ARGV[1] ticket id ('' to lease without a ticket)
-- ARGV[2] now
-- ARGV[3] lease deadline
-- ARGV[4] the shape bucket of the mini-batch
-- ARGV[5] most requests
-- ARGV[6] most rows
-- ARGV[7] most tokens (0: no limit), padded tokens for requests that will be padded
-- ARGV[8] how many queue entries to look at
-- ARGV[9] the lowest priority level to lease (a request submitted below it stays: its class is paused)
-- ARGV[10] the fair-share order, a JSON object {order [...], held [...]}, or '' for none: the requests of
--   tenants in `order` first (in its order, queue order within a tenant), then the others; a held
--   tenant's requests do not ride (it is past its limit)
-- ARGV[11] the key prefix of request hashes (`keys.request('')`): each leased request's inputs come back
-- Returns: {LEASE.STALE_TICKET} when the ticket is no longer valid; {LEASE.NOTHING} when none rides; else {n, id1, payload1, attempts1, inputs1, ...},
-- best first.
-- Items are never popped into the void: each one is in ready or in-flight at every instant.
-- KEYS by name (the positions above are the callers' contract).
local K = {tickets = KEYS[1], ready = KEYS[2], inflight = KEYS[3], items = KEYS[4], attempts = KEYS[5],
  waiting_requests = KEYS[6]}
if not ticket_valid(K.tickets, ARGV[1], ARGV[2]) then
  return {LEASE.STALE_TICKET}
end
local bucket = ARGV[4]
local max_items, max_rows, max_tokens = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local lowest_level = tonumber(ARGV[9]) or 0
local tenants = (ARGV[10] or '') ~= '' and cjson.decode(ARGV[10]) or nil
local rank, held, last = {}, {}, 1
if tenants then
  rank, held, last = tenant_ranks(tenants)
end

-- The queue entries to look at, {position, id} in queue order: the waiting requests among the first
-- `window` entries. While fewer requests wait than the window holds, they are found through the waiting
-- set and their ranks, so that a queue full of job chunks costs no payload decodes (a scan of 128 chunk
-- payloads held Redis for about 2 ms, at every look of a running chunk).
local window = tonumber(ARGV[8])
local waiting = redis.call('ZCARD', K.waiting_requests)
if waiting == 0 then
  return {LEASE.NOTHING}
end
local entries = {}
if waiting < window then
  for _, item_id in ipairs(redis.call('ZRANGE', K.waiting_requests, 0, -1)) do
    local rank = redis.call('ZRANK', K.ready, item_id)
    if rank and rank < window then
      entries[#entries + 1] = {rank + 1, item_id}
    end
  end
  table.sort(entries, function(a, b) return a[1] < b[1] end)
else
  for position, item_id in ipairs(redis.call('ZRANGE', K.ready, 0, window - 1)) do
    entries[position] = {position, item_id}
  end
end

-- The requests that may ride: {id, payload, rows, tokens, rank, position}, in the window's queue order.
local candidates = {}
for _, entry in ipairs(entries) do
  local position, item_id = entry[1], entry[2]
  local payload = redis.call('HGET', K.items, item_id) or '{}'
  local item = cjson.decode(payload)
  local factors = item['factors'] or {}
  local level = number_or(factors['base_level'], number_or(factors['level'], 0))
  local tenant = item['tenant'] or ''
  if item['kind'] == 'request' and item['bucket'] == bucket and level >= lowest_level and not held[tenant] then
    candidates[#candidates + 1] = {item_id, payload, number_or(item['rows'], 1),
      number_or(item['padded_tokens'], number_or(item['tokens'], 0)), rank[tenant] or last, position,
      item['req']}
  end
end
if tenants then
  table.sort(candidates, function(a, b)
    if a[5] ~= b[5] then
      return a[5] < b[5]
    end
    return a[6] < b[6]
  end)
end

local out, rows, tokens = {0}, 0, 0
for _, candidate in ipairs(candidates) do
  if out[1] >= max_items or rows >= max_rows then
    break
  end
  local item_id, payload, item_rows, item_tokens = candidate[1], candidate[2], candidate[3], candidate[4]
  if rows + item_rows <= max_rows and (max_tokens == 0 or tokens + item_tokens <= max_tokens) then
    redis.call('ZREM', K.ready, item_id)
    redis.call('ZADD', K.inflight, ARGV[3], item_id)
    redis.call('ZREM', K.waiting_requests, item_id)
    out[1] = out[1] + 1
    append_leased(out, item_id, payload, redis.call('HINCRBY', K.attempts, item_id, 1), ARGV[11], candidate[7])
    rows = rows + item_rows
    tokens = tokens + item_tokens
  end
end
return out
