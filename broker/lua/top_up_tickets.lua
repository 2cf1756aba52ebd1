-- top_up_tickets: create batch tickets until `target` circulate; the caller publishes one
-- Celery drain task per new ticket.
-- KEYS[1] tickets     ZSET ticket id -> last seen
-- KEYS[2] ticket seq  STRING counter
-- ARGV[1] now, ARGV[2] target
-- Returns: the new ticket ids.
local new = {}
local count = redis.call('ZCARD', KEYS[1])
while count < tonumber(ARGV[2]) do
  local ticket = 't' .. redis.call('INCR', KEYS[2])
  redis.call('ZADD', KEYS[1], ARGV[1], ticket)
  new[#new + 1] = ticket
  count = count + 1
end
return new
