-- take_reaper_turn: the reaper turn goes to a worker when no other worker holds it; its holder keeps it.
-- KEYS[1] reaper-turn STRING the name of the worker whose reaper thread passes now
-- ARGV[1] worker name, ARGV[2] milliseconds the turn lasts from now
-- Returns: 1 when ARGV[1] has the turn (taken, or renewed by its holder), 0 when another worker holds it.
-- The holder renews it at every tick, so a lone worker never skips a pass for a timer that fired a
-- little early; another worker takes over once the holder has missed its ticks for ARGV[2] ms.
-- KEYS by name (the positions above are the callers' contract).
local K = {reaper_turn = KEYS[1]}
local holder = redis.call('GET', K.reaper_turn)
if holder and holder ~= ARGV[1] then
  return 0
end
redis.call('SET', K.reaper_turn, ARGV[1], 'PX', ARGV[2])
return 1
