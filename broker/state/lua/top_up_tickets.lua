-- top_up_tickets: ring the doorbell (a lingering drain task looks at the queues again at once), then
-- create batch tickets until `target` circulate; the caller publishes one Celery drain task per new ticket.
-- KEYS[1] tickets     ZSET ticket id -> last seen
-- KEYS[2] ticket seq  STRING counter
-- KEYS[3] doorbell    LIST an idle drain task blocks on
-- ARGV[1] now, ARGV[2] target
-- Returns: the new ticket ids.
-- KEYS by name (the positions above are the callers' contract).
local K = {tickets = KEYS[1], ticket_seq = KEYS[2], doorbell = KEYS[3]}
ring_doorbell(K.doorbell)
return top_up_tickets(K.tickets, K.ticket_seq, ARGV[1], tonumber(ARGV[2]))
