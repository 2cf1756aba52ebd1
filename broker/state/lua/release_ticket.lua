-- release_ticket: retire a ticket, but only if no queue has waiting work (no lost wake-up:
-- an enqueue either happens before this check and is seen, or after it and tops up a ticket).
-- KEYS[1] tickets         ZSET
-- KEYS[2] queues version  STRING counter that moves when the set of queues gains or loses a ref
-- KEYS[3..] the ready ZSET of every model ref in the set of queues, as the caller read it
-- ARGV[1] ticket id
-- ARGV[2] the set's version read with those refs ('' for none)
-- Returns: RELEASE.RELEASED; RELEASE.WORK_WAITING (keep draining); RELEASE.SET_CHANGED, the queue set
-- changed (call again with the new set of ready keys).
-- KEYS by name (the positions above are the callers' contract).
local K = {tickets = KEYS[1], queues_version = KEYS[2]}
if (redis.call('GET', K.queues_version) or '') ~= ARGV[2] then
  return RELEASE.SET_CHANGED
end
for i = 3, #KEYS do
  if redis.call('ZCARD', KEYS[i]) > 0 then
    return RELEASE.WORK_WAITING
  end
end
redis.call('ZREM', K.tickets, ARGV[1])
return RELEASE.RELEASED
