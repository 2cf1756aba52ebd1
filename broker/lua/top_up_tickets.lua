-- top_up_tickets: ring the doorbell (a lingering drain task looks at the queues again at once), then
-- create batch tickets until `target` circulate; the caller publishes one Celery drain task per new ticket.
-- KEYS[1] tickets     ZSET ticket id -> last seen
-- KEYS[2] ticket seq  STRING counter
-- KEYS[3] doorbell    LIST an idle drain task blocks on
-- ARGV[1] now, ARGV[2] target
-- Returns: the new ticket ids.
redis.call('LPUSH', KEYS[3], '1')
redis.call('LTRIM', KEYS[3], 0, 63)
local new = {}
local count = redis.call('ZCARD', KEYS[1])
while count < tonumber(ARGV[2]) do
  local ticket = 't' .. redis.call('INCR', KEYS[2])
  redis.call('ZADD', KEYS[1], ARGV[1], ticket)
  new[#new + 1] = ticket
  count = count + 1
end
return new
