-- reap_leases: return items whose lease expired to their ready queue, or to the dead set when
-- they used up their attempts (a poison batch must not loop forever).
-- KEYS[1] inflight  ZSET item id -> lease deadline
-- KEYS[2] ready     ZSET
-- KEYS[3] items     HASH (the payload keeps the item's score)
-- KEYS[4] attempts  HASH
-- KEYS[5] dead      ZSET
-- KEYS[6] waiting requests ZSET a request returned to KEYS[2] counts as waiting again
-- ARGV[1] now, ARGV[2] max attempts, ARGV[3] most items to handle in this call
-- Returns: {returned, dead}.
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local returned, dead = 0, 0
for _, item_id in ipairs(expired) do
  redis.call('ZREM', KEYS[1], item_id)
  local payload = redis.call('HGET', KEYS[3], item_id)
  local attempts = tonumber(redis.call('HGET', KEYS[4], item_id) or '0')
  if payload then
    if attempts >= tonumber(ARGV[2]) then
      redis.call('ZADD', KEYS[5], ARGV[1], item_id)
      dead = dead + 1
    else
      local item = cjson.decode(payload)
      redis.call('ZADD', KEYS[2], item['score'], item_id)
      count_waiting_again(KEYS[6], item_id, item)
      returned = returned + 1
    end
  end
end
return {returned, dead}
