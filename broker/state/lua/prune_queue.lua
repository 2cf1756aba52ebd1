-- prune_queue: take a model ref out of the set of queues when it has no waiting and no leased item
-- (an older model version's drained queue), so that the set read before every batch choice does not
-- grow with every version ever registered. Anything that queues an item for the ref again adds it
-- back (`add_queue` in lib.lua); an item returned from a lease needs nothing, since a ref with a
-- leased item is never pruned.
-- KEYS[1] queues          SET model refs with a queue
-- KEYS[2] queues version  STRING counter (moves when KEYS[1] loses the ref)
-- KEYS[3] ready           ZSET the ref's waiting items (its tenant index's marks go with the ref: lib.lua)
-- KEYS[4] inflight        ZSET the ref's leased items
-- ARGV[1] model ref
-- Returns: 1 pruned, 0 kept (it has items, or was not in the set).
-- KEYS by name (the positions above are the callers' contract).
local K = {queues = KEYS[1], queues_version = KEYS[2], ready = KEYS[3], inflight = KEYS[4]}
if redis.call('ZCARD', K.ready) > 0 or redis.call('ZCARD', K.inflight) > 0 then
  return 0
end
if redis.call('SREM', K.queues, ARGV[1]) == 0 then
  return 0
end
redis.call('INCR', K.queues_version)
-- (its tenant indexes are empty with it; their marks go: `add_queue` marks the index built again)
redis.call('DEL', K.ready .. TENANT_INDEX_BUILT, K.ready .. TENANT_INDEX_CURSOR)
return 1
