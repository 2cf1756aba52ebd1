-- expire_requests: apply the queue policy's timeout_action to a model's waiting requests whose timeout
-- has passed, found through its timeout index, not by scanning the queue.
-- KEYS[1] request timeouts ZSET request id -> when its timeout passes
-- KEYS[2] ready      ZSET item id -> score (and its tenants' indexes beside it: lib.lua's `ready_remove`)
-- KEYS[3] inflight   ZSET item id -> lease deadline
-- KEYS[4] items      HASH item id -> payload
-- KEYS[5] waiting requests ZSET the model's online requests not leased
-- KEYS[6] deadlines  ZSET the PSA index
-- ARGV[1] now, ARGV[2] lease deadline for the rejected, ARGV[3] most index entries to look at
-- Returns {n, id1, payload1, ..., idn, payloadn, delayed id...}: the n rejected requests, now leased
-- to the caller, which fails them as timed out at once; then the delayed ones, which the caller
-- re-scores.
-- reject (the payload has expires_at): the request moves to the in-flight set, as a lease. Should
-- its caller die before failing it, the reaper returns it, and the next pass rejects it again.
-- delay (delay_at): it stays queued at level 0 (`base_level` keeps its own), out of the PSA index,
-- and leaves the timeout index.
-- A request leased by a worker keeps its entry (an expired lease brings it back); one gone loses it.
-- KEYS by name (the positions above are the callers' contract).
local K = {request_timeouts = KEYS[1], ready = KEYS[2], inflight = KEYS[3], items = KEYS[4],
  waiting_requests = KEYS[5], deadlines = KEYS[6]}
local due = redis.call('ZRANGEBYSCORE', K.request_timeouts, '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local rejected, delayed = {}, {}
for _, item_id in ipairs(due) do
  local payload = redis.call('HGET', K.items, item_id)
  local item = payload and cjson.decode(payload)
  if not item or (type(item['expires_at']) ~= 'number' and type(item['delay_at']) ~= 'number') then
    redis.call('ZREM', K.request_timeouts, item_id)
  elseif redis.call('ZSCORE', K.ready, item_id) then
    if type(item['expires_at']) == 'number' then
      ready_remove(K.ready, item_id, item_tenant(item))
      redis.call('ZREM', K.waiting_requests, item_id)
      redis.call('ZADD', K.inflight, ARGV[2], item_id)
      rejected[#rejected + 1] = {item_id, payload}
    else
      local factors = item['factors']
      if type(factors) == 'table' then
        factors['base_level'] = number_or(factors['base_level'], number_or(factors['level'], 0))
        factors['level'] = 0
        redis.call('HSET', K.items, item_id, cjson.encode(item))
      end
      redis.call('ZREM', K.deadlines, item_id)
      redis.call('ZREM', K.request_timeouts, item_id)
      delayed[#delayed + 1] = item_id
    end
  end
end
local out = {#rejected}
for _, entry in ipairs(rejected) do
  out[#out + 1] = entry[1]
  out[#out + 1] = entry[2]
end
for _, item_id in ipairs(delayed) do
  out[#out + 1] = item_id
end
return out
