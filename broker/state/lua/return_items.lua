-- return_items: put leased items that never ran back in their ready queue at once, their lease
-- attempt not counted (a worker leased them, then found it could not run them: a job chunk whose
-- mini-batches do not fit the device's free memory now).
-- KEYS[1] inflight  ZSET item id -> lease deadline
-- KEYS[2] ready     ZSET item id -> score (and its tenants' indexes beside it: lib.lua's `ready_add`)
-- KEYS[3] items     HASH item id -> payload (it keeps the item's current score)
-- KEYS[4] attempts  HASH item id -> lease count
-- KEYS[5] doorbell  LIST an idle drain task blocks on
-- KEYS[6] waiting requests ZSET a request returned to KEYS[2] counts as waiting again
-- ARGV    the item ids
-- Returns: how many were returned. An item no longer in flight (reaped, finished, or returned
-- already) is left alone, so a late or repeated call changes nothing.
-- KEYS by name (the positions above are the callers' contract).
local K = {inflight = KEYS[1], ready = KEYS[2], items = KEYS[3], attempts = KEYS[4], doorbell = KEYS[5],
  waiting_requests = KEYS[6]}
local returned = 0
for _, item_id in ipairs(ARGV) do
  local payload = redis.call('HGET', K.items, item_id)
  if payload and redis.call('ZREM', K.inflight, item_id) == 1 then
    local item = cjson.decode(payload)
    ready_add(K.ready, item_id, item['score'], item_tenant(item))
    count_waiting_again(K.waiting_requests, item_id, item)
    if tonumber(redis.call('HINCRBY', K.attempts, item_id, -1)) <= 0 then
      redis.call('HDEL', K.attempts, item_id)
    end
    returned = returned + 1
  end
end
if returned > 0 then
  ring_doorbell(K.doorbell)
end
return returned
