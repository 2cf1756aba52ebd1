-- re_estimate: give waiting online requests a new latency estimate and re-score them, each only where its
-- stored estimate is still the one the caller read (a compare-and-set per item).
-- KEYS[1] ready   ZSET item id -> score (its tenants' indexes too: lib.lua's `tenant_index`)
-- KEYS[2] items   HASH item id -> payload (its 'factors' say what the score is made of)
-- KEYS[3] policy  STRING the live policy JSON
-- ARGV[1] the policy JSON the caller scores with ('' for the defaults), ARGV[2] ordering ('fifo' | 'dynamic'),
-- ARGV[3..9] alpha, beta, gamma, delta, express_level, express_max_tokens, express_bonus
-- ARGV[10..] in threes: item id, its `est_latency_ms` as the caller read it ('' for none), the new estimate
-- Returns: {0} when the live policy is no longer ARGV[1] (nothing written: read it again and retry);
-- else {1, then per item re-estimated: its id, its score before, its score now}. An item no longer waiting
-- or whose estimate changed since the caller read it (another pass was first) is left as it is, so two
-- passes at once re-estimate an item once. The score is recomputed from the payload as it is now, so a
-- PSA jump made meanwhile keeps its level.
-- The score is lib.lua's `queue_key`, exactly what broker/queueing/scoring.py queue_key computes.
-- KEYS by name (the positions above are the callers' contract).
local K = {ready = KEYS[1], items = KEYS[2], policy = KEYS[3]}
if (redis.call('GET', K.policy) or '') ~= ARGV[1] then
  return {0}
end
local W = score_weights(ARGV[2], 3)  -- (lib.lua's `queue_key` scores with it)

-- Is the stored estimate `stored` the one the caller read (`expected`, '' for none)?
local function same_estimate(stored, expected)
  if type(stored) ~= 'number' then
    return expected == ''
  end
  return expected ~= '' and stored == tonumber(expected)
end

local out = {1}
for i = 10, #ARGV, 3 do
  local item_id = ARGV[i]
  local before = redis.call('ZSCORE', K.ready, item_id)
  local payload = before and redis.call('HGET', K.items, item_id)
  if payload then
    local item = cjson.decode(payload)
    local f = item['factors']
    if type(f) == 'table' and same_estimate(f['est_latency_ms'], ARGV[i + 1]) then
      f['est_latency_ms'] = tonumber(ARGV[i + 2])
      local key = queue_key(f, W)
      item['score'] = key
      redis.call('HSET', K.items, item_id, cjson.encode(item))
      redis.call('ZADD', K.ready, key, item_id)
      redis.call('ZADD', tenant_index(K.ready, item_tenant(item)), key, item_id)
      out[#out + 1] = item_id
      out[#out + 1] = before
      out[#out + 1] = string.format('%.17g', key)
    end
  end
end
return out
