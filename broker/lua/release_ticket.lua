-- release_ticket: retire a ticket, but only if no queue has waiting work (no lost wake-up:
-- an enqueue either happens before this check and is seen, or after it and tops up a ticket).
-- KEYS[1] tickets  ZSET
-- KEYS[2] queues   SET of model refs
-- KEYS[3..] the ready ZSET of every model ref in KEYS[2]
-- ARGV[1] ticket id
-- Returns: 1 released; 0 work is waiting (keep draining); -1 the queue set changed (call again
-- with the new set of ready keys).
if redis.call('SCARD', KEYS[2]) ~= #KEYS - 2 then
  return -1
end
for i = 3, #KEYS do
  if redis.call('ZCARD', KEYS[i]) > 0 then
    return 0
  end
end
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
