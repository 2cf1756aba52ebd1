-- queue_snapshot: what a drain loop looks at before it chooses its next batch, as of one instant.
-- KEYS[1] queues version  STRING counter that moves when the set of queues gains or loses a ref
-- KEYS[2] policy          STRING the live policy JSON
-- KEYS[3] doorbell        LIST idle drain loops block on; emptied here: its rings came before this look,
--          which sees the work they announced (a loop blocked when one came was woken by it then). Left
--          standing, each would wake a loop later for one more look at queues it has seen already.
-- KEYS[4], KEYS[5], ... per model ref the caller knows of, in threes:
--          ready      ZSET item id -> score
--          deadlines  ZSET item id -> deadline (the waiting items that have one)
--          waiting requests ZSET the online requests among the ready items
-- Returns: {the set's version or '', policy JSON or '', 1 if the doorbell held rings (no drain loop was
--          blocked on it when they came) else 0, then per three keys: the head item's id,
--          its score, the earliest deadline, how many online requests wait} ('' for what an empty
--          set lacks). When the version differs from the one the caller read with its refs, its list
--          of refs is out of date.
-- KEYS by name (the positions above are the callers' contract).
local K = {queues_version = KEYS[1], policy = KEYS[2], doorbell = KEYS[3]}
local unclaimed = redis.call('DEL', K.doorbell)
local reply = {redis.call('GET', K.queues_version) or '', redis.call('GET', K.policy) or '', unclaimed}
for index = 4, #KEYS, 3 do
  local head = redis.call('ZRANGE', KEYS[index], 0, 0, 'WITHSCORES')
  local earliest = redis.call('ZRANGE', KEYS[index + 1], 0, 0, 'WITHSCORES')
  reply[#reply + 1] = head[1] or ''
  reply[#reply + 1] = head[2] or ''
  reply[#reply + 1] = earliest[2] or ''
  reply[#reply + 1] = redis.call('ZCARD', KEYS[index + 2])
end
return reply
