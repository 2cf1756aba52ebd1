-- submit_request: store an online request and queue it, in one step.
-- KEYS[1] ready      ZSET item id -> score
-- KEYS[2] items      HASH item id -> payload
-- KEYS[3] queues     SET model refs with a queue
-- KEYS[4] request    HASH the request's fields, inputs and (later) outputs
-- KEYS[5] deadlines  ZSET item id -> deadline (the PSA index)
-- ARGV[1] model ref, ARGV[2] request id (also its item id), ARGV[3] JSON object of request fields
-- ARGV[4] score, ARGV[5] item payload JSON, ARGV[6] deadline (unix seconds) or ''
-- ARGV[7] seconds the request hash may live at most (a result nobody fetches must not stay forever)
-- Returns: 1, or 0 when a request with that id exists already.
if redis.call('EXISTS', KEYS[4]) == 1 then
  return 0
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
redis.call('SADD', KEYS[3], ARGV[1])
return 1
