-- extend_leases: keep the leases of running items (and the slot's ticket) alive, in one step. An item
-- no longer in flight stays gone (reaped, finished or stopped meanwhile), and a parked one keeps the
-- deadline its backoff set (`retry_item.lua`): moving it would hold the retry a whole lease, and the
-- reaper would take the mismatch for a lost lease.
-- KEYS[1] tickets   ZSET ticket id -> last seen
-- KEYS[2..] for each item in order: its model's inflight ZSET (item id -> lease deadline), then its
--           model's retrying ZSET (the parked items)
-- ARGV[1] the new lease deadline, ARGV[2] now, ARGV[3] the ticket ('' for none), ARGV[4..] the item ids
-- Returns how many leases were extended.
-- KEYS by name (the positions above are the callers' contract).
local K = {tickets = KEYS[1]}
local extended = 0
for i = 4, #ARGV do
  local inflight, retrying = KEYS[2 + 2 * (i - 4)], KEYS[3 + 2 * (i - 4)]
  if not redis.call('ZSCORE', retrying, ARGV[i]) then
    extended = extended + redis.call('ZADD', inflight, 'XX', 'CH', ARGV[1], ARGV[i])
  end
end
if ARGV[3] ~= '' then
  redis.call('ZADD', K.tickets, 'XX', ARGV[2], ARGV[3])
end
return extended
