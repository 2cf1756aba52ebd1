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
-- Must compute exactly what broker/queueing/scoring.py queue_key computes (as rescore.lua does).
-- KEYS by name (the positions above are the callers' contract).
local K = {ready = KEYS[1], items = KEYS[2], policy = KEYS[3]}
if (redis.call('GET', K.policy) or '') ~= ARGV[1] then
  return {0}
end
local EPOCH = 1704067200.0
local ordering = ARGV[2]
local alpha, beta, gamma, delta = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local express_level, express_max_tokens = tonumber(ARGV[7]), tonumber(ARGV[8])
local express_bonus = tonumber(ARGV[9])

local function queue_key(f)
  if ordering == 'fifo' then
    return number_or(f['enqueued_at'], 0) - EPOCH
  end
  local enqueued_at = number_or(f['enqueued_at'], 0)
  local since = number_or(f['order_at'], enqueued_at)
  local level = number_or(f['level'], 0)
  local max_level = number_or(f['max_level'], 15)
  if type(f['order_at']) == 'number' and max_level < 15 and delta > 0 then
    -- a capped item's deadline gains it at most its cap's points (scoring.py aging_since, deadline_reach)
    since = math.max(since, enqueued_at - math.max(max_level - level, 0) / delta)
  end
  since = since - EPOCH
  local latency_points = 0
  local latency = f['est_latency_ms']
  if type(latency) == 'number' then
    latency_points = math.min(100.0 / math.max(latency, 0.001), 10.0)
  end
  local points = level + alpha * latency_points + beta * number_or(f['sla_weight'], 1.0)
    + gamma * number_or(f['complexity'], 0.0)
  local key = delta * since - points
  local tokens = f['tokens']
  -- (a short request takes the express lane only for a tenant that may ask its level: scoring.py is_express)
  if level >= express_level
      or (type(tokens) == 'number' and tokens < express_max_tokens and max_level >= express_level) then
    key = key - express_bonus
  end
  return key
end

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
      local key = queue_key(f)
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
