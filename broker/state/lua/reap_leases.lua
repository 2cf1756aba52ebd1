-- reap_leases: return items whose lease expired to their ready queue, at the score their payload
-- keeps, or to the dead set when they used up their attempts (a poison batch must not loop forever).
-- An expired item is either parked for a retry (`retry_item.lua`: its backoff has passed) or its worker
-- was lost (it died, froze, or lost Redis); only lost leases count against the attempts, and only they
-- may wait a backoff of their own (`retry.worker_lost`).
-- KEYS[1] inflight  ZSET item id -> lease deadline
-- KEYS[2] ready     ZSET (and its tenants' indexes beside it: lib.lua's `ready_add`)
-- KEYS[3] items     HASH (the payload keeps the item's score)
-- KEYS[4] attempts  HASH item id -> lease count
-- KEYS[5] dead      ZSET
-- KEYS[6] waiting requests ZSET a request returned to KEYS[2] counts as waiting again
-- KEYS[7] retrying  ZSET item id -> when a parked item may run again (its deadline in KEYS[1] too)
-- ARGV[1] now, ARGV[2] max attempts (of lost leases), ARGV[3] most items to handle in this call
-- ARGV[4] JSON list: the wait after the n-th lost lease before the item is queued again ([] : none)
-- Returns: {returned, dead, lost item id, its retry time ('' : queued now), ...}: the lost leases (not
-- those gone dead), whose failures the caller records.
-- KEYS by name (the positions above are the callers' contract).
local K = {inflight = KEYS[1], ready = KEYS[2], items = KEYS[3], attempts = KEYS[4], dead = KEYS[5],
  waiting_requests = KEYS[6], retrying = KEYS[7]}
local expired = redis.call('ZRANGEBYSCORE', K.inflight, '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[3]))
local delays = cjson.decode(ARGV[4] or '[]')
local now = tonumber(ARGV[1])
local reply = {0, 0}
for i = 1, #expired, 2 do
  local item_id, deadline = expired[i], tonumber(expired[i + 1])
  -- Parked: its mark says the very deadline it has (a mark left from before its job was stopped and
  -- resumed does not, and is dropped here).
  local mark = redis.call('ZSCORE', K.retrying, item_id)
  local parked = mark and tonumber(mark) == deadline
  if mark then
    redis.call('ZREM', K.retrying, item_id)
  end
  local payload = redis.call('HGET', K.items, item_id)
  local attempts = tonumber(redis.call('HGET', K.attempts, item_id) or '0')
  local delay = delays[attempts]
  if not payload then
    redis.call('ZREM', K.inflight, item_id)
  elseif not parked and attempts >= tonumber(ARGV[2]) then
    redis.call('ZREM', K.inflight, item_id)
    redis.call('ZADD', K.dead, ARGV[1], item_id)
    reply[2] = reply[2] + 1
  elseif not parked and delay ~= nil and delay > 0 then
    redis.call('ZADD', K.inflight, now + delay, item_id)
    redis.call('ZADD', K.retrying, now + delay, item_id)
    reply[#reply + 1] = item_id
    reply[#reply + 1] = tostring(now + delay)
  else
    redis.call('ZREM', K.inflight, item_id)
    local item = cjson.decode(payload)
    ready_add(K.ready, item_id, item['score'], item_tenant(item))
    count_waiting_again(K.waiting_requests, item_id, item)
    reply[1] = reply[1] + 1
    if not parked then
      reply[#reply + 1] = item_id
      reply[#reply + 1] = ''
    end
  end
end
-- Marks whose time has passed and that no longer say an item's deadline go too: their item left the
-- in-flight set otherwise (its job was stopped), or was leased again since (its job resumed).
local marks = redis.call('ZRANGEBYSCORE', K.retrying, '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[3]))
for i = 1, #marks, 2 do
  local deadline = redis.call('ZSCORE', K.inflight, marks[i])
  if not deadline or tonumber(deadline) ~= tonumber(marks[i + 1]) then
    redis.call('ZREM', K.retrying, marks[i])
  end
end
return reply
