-- psa_jump: raise the level of waiting items whose deadline is near while their queue is loaded
-- (the PSA priority jump), found through the model's deadline index, not by scanning the queue.
-- KEYS[1] deadlines  ZSET item id -> deadline (unix seconds), this model's
-- KEYS[2] ready      ZSET
-- KEYS[3] inflight   ZSET
-- KEYS[4] items      HASH item id -> payload
-- ARGV[1] now, ARGV[2] psa_rtd_ms, ARGV[3] psa_load, ARGV[4] psa_max_base_level,
-- ARGV[5] the queue's capacity (load = (waiting + leased) / capacity)
-- Returns: {load x 1000, id of every item whose level rose...}; the caller re-scores those ids.
-- Decision (as broker/queueing/scoring.py psa_jump_level): remaining delay < psa_rtd_ms, load > psa_load,
-- base level < psa_max_base_level  ->  level 15 under 100 ms, else 12, but never past the tenant's cap
-- (factors.max_level, 15 when absent): no jump when the cap is not above the base level. Items leased,
-- gone, at 15 or at their cap, or not eligible leave the index.
-- KEYS by name (the positions above are the callers' contract).
local K = {deadlines = KEYS[1], ready = KEYS[2], inflight = KEYS[3], items = KEYS[4]}
local now = tonumber(ARGV[1])
local load = (redis.call('ZCARD', K.ready) + redis.call('ZCARD', K.inflight)) / tonumber(ARGV[5])
local out = {math.floor(load * 1000)}
if load <= tonumber(ARGV[3]) then
  return out
end
local due = redis.call('ZRANGEBYSCORE', K.deadlines, '-inf', now + tonumber(ARGV[2]) / 1000, 'WITHSCORES', 'LIMIT', 0, 256)
for i = 1, #due, 2 do
  local item_id, deadline = due[i], tonumber(due[i + 1])
  local payload = redis.call('HGET', K.items, item_id)
  if not payload or not redis.call('ZSCORE', K.ready, item_id) then
    redis.call('ZREM', K.deadlines, item_id)
  else
    local item = cjson.decode(payload)
    local factors = item['factors']
    local base = factors['base_level']
    if type(base) ~= 'number' then
      base = factors['level']
    end
    local cap = number_or(factors['max_level'], 15)
    if base >= tonumber(ARGV[4]) or cap <= base then
      redis.call('ZREM', K.deadlines, item_id)
    else
      local target = 12
      if (deadline - now) * 1000 < 100 then
        target = 15
      end
      target = math.min(target, cap)
      if target > factors['level'] then
        factors['base_level'] = base
        factors['level'] = target
        redis.call('HSET', K.items, item_id, cjson.encode(item))
        out[#out + 1] = item_id
      end
      if target == cap then  -- it can rise no further
        redis.call('ZREM', K.deadlines, item_id)
      end
    end
  end
end
return out
