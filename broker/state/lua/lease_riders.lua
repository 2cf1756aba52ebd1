-- lease_riders: lease online requests of one shape bucket from near the front of a model's queue,
-- to ride along in the next mini-batch of a job chunk of that model (one inference run for both).
-- Unlike lease_batch, the head need not be a request: requests queued behind job chunks are found
-- too, within the first ARGV[8] entries (a bounded scan, so the call stays short; while few requests
-- wait, only their entries are read).
-- KEYS[1] tickets   ZSET ticket id -> last seen
-- KEYS[2] ready     ZSET item id -> score (and its tenants' indexes beside it: lib.lua's `ready_remove`)
-- KEYS[3] inflight  ZSET item id -> lease deadline
-- KEYS[4] items     HASH item id -> payload
-- KEYS[5] attempts  HASH item id -> lease count
-- KEYS[6] waiting requests ZSET the model's online requests not leased (leased ones leave it)
-- KEYS[7] served    HASH tenant -> when its requests of the model were last answered, or until when a lease
--           keeps them present (ARGV[12])
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
-- ARGV[12] the tenants' shares, lease_batch.lua's `shares` option as JSON, or '' for none: split as a batch
--   of requests is (lib.lua's `share_split`, broker/tenants/batch_shares.py), the first ranked tenant present
--   on the model its anchor: its riders go first, every other tenant's add at most its share's part of their
--   rows (none without a share); while the anchor is present with no request waiting within the window, none
--   ride; the riders' tenants are marked leased (lib.lua's `mark_leased`)
-- A request past its `reject` timeout (payload `expires_at`) neither rides nor counts as its tenant's work
-- (lib.lua's `request_expired`): it waits for its failure (expire_requests.lua).
-- Returns: {LEASE.STALE_TICKET} when the ticket is no longer valid; {LEASE.NOTHING} when none rides; else {n, id1, payload1, attempts1, inputs1, ...},
-- best first.
-- Items are never popped into the void: each one is in ready or in-flight at every instant.
-- KEYS by name (the positions above are the callers' contract).
local K = {tickets = KEYS[1], ready = KEYS[2], inflight = KEYS[3], items = KEYS[4], attempts = KEYS[5],
  waiting_requests = KEYS[6], served = KEYS[7]}
if not ticket_valid(K.tickets, ARGV[1], ARGV[2]) then
  return {LEASE.STALE_TICKET}
end
local bucket = ARGV[4]
local max_items, max_rows, max_tokens = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local lowest_level = tonumber(ARGV[9]) or 0
local tenants = (ARGV[10] or '') ~= '' and cjson.decode(ARGV[10]) or nil
local shares = (ARGV[12] or '') ~= '' and cjson.decode(ARGV[12]) or nil
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

-- The requests that may ride: {id, payload, rows, tokens, rank, position, req, tenant}, in the window's queue
-- order; and tenant -> its requests within the window that this lease may take, of any bucket (`shares`).
local candidates, waiting_by_tenant = {}, {}
for _, entry in ipairs(entries) do
  local position, item_id = entry[1], entry[2]
  local payload = redis.call('HGET', K.items, item_id) or '{}'
  local item = cjson.decode(payload)
  local factors = item['factors'] or {}
  local level = number_or(factors['base_level'], number_or(factors['level'], 0))
  local tenant = item_tenant(item)
  if item['kind'] == 'request' and level >= lowest_level and not held[tenant]
      and not request_expired(item, ARGV[2]) then
    waiting_by_tenant[tenant] = (waiting_by_tenant[tenant] or 0) + 1
    if item['bucket'] == bucket then
      candidates[#candidates + 1] = {id = item_id, payload = payload, rows = number_or(item['rows'], 1),
        tokens = number_or(item['padded_tokens'], number_or(item['tokens'], 0)), rank = rank[tenant] or last,
        position = position, req = item['req'], tenant = tenant}
    end
  end
end

-- The share split, as a batch of requests gets it, the anchor in the head's place: nil (no caps) or
-- {anchor, quotas, hold}.
local split = nil
if shares then
  local served_at = served_times(K.served, shares)
  local anchor = share_anchor(shares, waiting_by_tenant, served_at, tonumber(ARGV[2]))
  local anchor_rows = 0
  for _, candidate in ipairs(candidates) do
    if candidate.tenant == anchor then
      anchor_rows = anchor_rows + candidate.rows
      candidate.rank = 0  -- (its riders go first, wherever the order put it)
    end
  end
  split = share_split(shares, waiting_by_tenant, served_at, anchor, math.min(anchor_rows, max_rows),
    tonumber(ARGV[2]))
  if split ~= nil and split.hold then
    return {LEASE.NOTHING}
  end
end
if tenants or shares then
  table.sort(candidates, function(a, b)
    if a.rank ~= b.rank then
      return a.rank < b.rank
    end
    return a.position < b.position
  end)
end

local out, rows, tokens = {0}, 0, 0
local taken, riding = {}, {}  -- tenant -> rows of its riders; tenant -> true
for _, candidate in ipairs(candidates) do
  if out[1] >= max_items or rows >= max_rows then
    break
  end
  local most = share_quota(split, candidate.tenant)
  if rows + candidate.rows <= max_rows and (max_tokens == 0 or tokens + candidate.tokens <= max_tokens)
      and (most == nil or (taken[candidate.tenant] or 0) + candidate.rows <= most) then
    ready_remove(K.ready, candidate.id, candidate.tenant)
    redis.call('ZADD', K.inflight, ARGV[3], candidate.id)
    redis.call('ZREM', K.waiting_requests, candidate.id)
    out[1] = out[1] + 1
    append_leased(out, candidate.id, candidate.payload, redis.call('HINCRBY', K.attempts, candidate.id, 1), ARGV[11],
      candidate.req)
    rows = rows + candidate.rows
    tokens = tokens + candidate.tokens
    taken[candidate.tenant] = (taken[candidate.tenant] or 0) + candidate.rows
    riding[candidate.tenant] = true
  end
end
if shares then
  mark_leased(K.served, riding, ARGV[2], shares)
end
return out
