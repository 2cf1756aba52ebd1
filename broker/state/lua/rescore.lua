-- rescore: recompute the scores of one bounded slice of a queue under new weights (hot update).
-- KEYS[1] the queue to walk: a ready ZSET (scores are rewritten, in its tenants' indexes too: lib.lua's
--         `tenant_index`) or an in-flight ZSET (only the payload's score is, so a lease that expires goes back
--         with the new score)
-- KEYS[2] items HASH item id -> payload (its 'factors' say what the score is made of)
-- ARGV[1] ZSCAN cursor ('0' to start), ARGV[2] ZSCAN COUNT (bounds the work of one call)
-- ARGV[3] 'ready' | 'inflight' | 'ids' (re-score just the ready items named in ARGV[12..], e.g.
--         after a PSA jump changed their level; ARGV[1] and ARGV[2] are then ignored)
-- ARGV[4] ordering ('fifo' | 'dynamic'), ARGV[5..11] alpha, beta, gamma, delta, express_level,
--         express_max_tokens, express_bonus
-- Returns: {next cursor ('0' when the walk is complete), items rescored in this call}.
-- ZSCAN returns every member present for the whole walk at least once; rescoring twice gives the
-- same score, and members added meanwhile were scored with the new weights already.
-- The score is lib.lua's `queue_key`, exactly what broker/queueing/scoring.py queue_key computes.
-- KEYS by name (the positions above are the callers' contract).
local K = {queue = KEYS[1], items = KEYS[2]}
local W = score_weights(ARGV[4], 5)  -- (lib.lua's `queue_key` scores with it)

local next_cursor, ids = '0', {}
if ARGV[3] == 'ids' then
  for i = 12, #ARGV do
    ids[#ids + 1] = ARGV[i]
  end
else
  local scan = redis.call('ZSCAN', K.queue, ARGV[1], 'COUNT', ARGV[2])
  next_cursor = scan[1]
  for i = 1, #scan[2], 2 do
    ids[#ids + 1] = scan[2][i]
  end
end
local done = 0
for _, item_id in ipairs(ids) do
  local payload = redis.call('HGET', K.items, item_id)
  if payload then
    local item = cjson.decode(payload)
    if type(item['factors']) == 'table' then
      local key = queue_key(item['factors'], W)
      item['score'] = key
      redis.call('HSET', K.items, item_id, cjson.encode(item))
      if ARGV[3] ~= 'inflight' and redis.call('ZADD', K.queue, 'XX', 'CH', key, item_id) == 1 then
        redis.call('ZADD', tenant_index(K.queue, item_tenant(item)), key, item_id)  -- (its tenant's index too)
      end
      done = done + 1
    end
  end
end
return {next_cursor, done}
