-- submit_request: store an online request, queue it, ring the doorbell and top tickets up, in one step.
-- KEYS[1] ready       ZSET item id -> score
-- KEYS[2] items       HASH item id -> payload
-- KEYS[3] queues      SET model refs with a queue
-- KEYS[4] request     HASH the request's fields, inputs and (later) outputs
-- KEYS[5] deadlines   ZSET item id -> deadline (the PSA index)
-- KEYS[6] policy      STRING the live policy JSON
-- KEYS[7] tickets     ZSET ticket id -> last seen
-- KEYS[8] ticket seq  STRING counter
-- KEYS[9] doorbell    LIST an idle drain task blocks on
-- KEYS[10] queues version STRING counter (moves when KEYS[3] gains a ref)
-- ARGV[1] model ref, ARGV[2] request id (also its item id), ARGV[3] JSON object of request fields
-- ARGV[4] score, ARGV[5] item payload JSON, ARGV[6] deadline (unix seconds) or ''
-- ARGV[7] seconds the request hash may live at most (a result nobody fetches must not stay forever)
-- ARGV[8] the policy JSON the score was computed with ('' for the defaults)
-- ARGV[9] now, ARGV[10] how many tickets should circulate
-- Returns: {1, new ticket ids...}; {0} when a request with that id exists already; {-1} when the
-- live policy is no longer ARGV[8] (nothing written: score again with the live policy and retry,
-- so no item is ever queued with the weights of a policy that a re-score has already replaced).
if (redis.call('GET', KEYS[6]) or '') ~= ARGV[8] then
  return {-1}
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  return {0}
end
for name, value in pairs(cjson.decode(ARGV[3])) do
  redis.call('HSET', KEYS[4], name, tostring(value))
end
redis.call('EXPIRE', KEYS[4], ARGV[7])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[5])
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[2])
if ARGV[6] ~= '' then
  redis.call('ZADD', KEYS[5], ARGV[6], ARGV[2])
end
add_queue(KEYS[3], KEYS[10], ARGV[1])
-- What top_up_tickets.lua does, here too, so that a submit is one round trip.
ring_doorbell(KEYS[9])
local out = {1}
for _, ticket in ipairs(top_up_tickets(KEYS[7], KEYS[8], ARGV[9], tonumber(ARGV[10]))) do
  out[#out + 1] = ticket
end
return out
