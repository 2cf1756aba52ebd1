-- lease_batch: move the best items of one model's queue into its in-flight set (late binding).
-- KEYS[1] tickets   ZSET ticket id -> last seen
-- KEYS[2] ready     ZSET item id -> score
-- KEYS[3] inflight  ZSET item id -> lease deadline
-- KEYS[4] items     HASH item id -> payload
-- KEYS[5] attempts  HASH item id -> lease count
-- ARGV[1] ticket id ('' to lease without a ticket)
-- ARGV[2] now
-- ARGV[3] lease deadline
-- ARGV[4] max items
-- Returns: {-1} when the ticket is no longer valid (a stale copy of a replaced ticket);
--          {0} when the queue is empty; else {n, id1, payload1, attempts1, ...}.
-- Items are never popped into the void: each one is in ready or in-flight at every instant.
if ARGV[1] ~= '' then
  if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
    return {-1}
  end
  redis.call('ZADD', KEYS[1], 'XX', ARGV[2], ARGV[1])
end
local ids = redis.call('ZRANGE', KEYS[2], 0, tonumber(ARGV[4]) - 1)
local out = {#ids}
for _, item_id in ipairs(ids) do
  redis.call('ZREM', KEYS[2], item_id)
  redis.call('ZADD', KEYS[3], ARGV[3], item_id)
  local attempts = redis.call('HINCRBY', KEYS[5], item_id, 1)
  out[#out + 1] = item_id
  out[#out + 1] = redis.call('HGET', KEYS[4], item_id) or ''
  out[#out + 1] = attempts
end
return out
