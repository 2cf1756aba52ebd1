-- keep_hold: renew or drop a hold, but only while the caller still holds it.
-- KEYS[1] hold STRING the token of whoever holds it now (taken with SET NX PX)
-- ARGV[1] the caller's token, ARGV[2] milliseconds the hold lasts from now (0: drop it)
-- Returns: 1 when the caller held it (renewed, or dropped), 0 when it had lapsed or another holds it.
-- Without the comparison a holder whose hold lapsed (a pause, a failover that lost the key) would
-- extend, or delete, the hold another has taken since, and a third could take it beside that one.
-- KEYS by name (the positions above are the callers' contract).
local K = {hold = KEYS[1]}
if redis.call('GET', K.hold) ~= ARGV[1] then
  return 0
end
if tonumber(ARGV[2]) > 0 then
  redis.call('PEXPIRE', K.hold, ARGV[2])
else
  redis.call('DEL', K.hold)
end
return 1
