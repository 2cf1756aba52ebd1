-- settle_run: move one run of a schedule on from the status it is in: released, refused, missed, held
-- (again, with a new reason), or releasing again (a held run whose steps before it succeeded).
-- KEYS[1] schedule-runs:<member> HASH slot -> JSON run
-- KEYS[2] schedule-runs-releasing ZSET 'member|slot' -> when its release was sent
-- KEYS[3] schedule-runs-held ZSET 'member|slot' -> when the beat looks at it again
-- KEYS[4] schedule-stats HASH 'member|<what>' -> running totals
-- ARGV[1] member, ARGV[2] JSON {slot, expect (the statuses it may be in), status, run (the new run's JSON
--   text), at (the releasing or held index's score), add ({what: amount} to the totals), set ({what: value})}
-- Returns {SETTLE.SETTLED}; {SETTLE.MOVED, run JSON} when the run is in none of `expect` (another releaser
-- or beat settled it first); {SETTLE.GONE} when the run is no longer kept (its schedule deleted).
-- KEYS by name (the positions above are the callers' contract).
local K = {runs = KEYS[1], releasing = KEYS[2], held = KEYS[3], stats = KEYS[4]}
local member = ARGV[1]
local options = cjson.decode(ARGV[2])
local field = string.format('%d', tonumber(options['slot']))
local stored = redis.call('HGET', K.runs, field)
if not stored then
  return {SETTLE.GONE}
end
local current = cjson.decode(stored)['status']
local expected = false
for _, status in ipairs(options['expect']) do
  if status == current then
    expected = true
  end
end
if not expected then
  return {SETTLE.MOVED, stored}
end
local run_id = member .. '|' .. field
redis.call('HSET', K.runs, field, options['run'])
redis.call('ZREM', K.releasing, run_id)
redis.call('ZREM', K.held, run_id)
if options['status'] == 'releasing' then
  redis.call('ZADD', K.releasing, options['at'], run_id)
elseif options['status'] == 'held' then
  redis.call('ZADD', K.held, options['at'], run_id)
end
for what, amount in pairs(options['add'] or {}) do
  redis.call('HINCRBYFLOAT', K.stats, member .. '|' .. what, amount)
end
for what, value in pairs(options['set'] or {}) do
  redis.call('HSET', K.stats, member .. '|' .. what, value)
end
return {SETTLE.SETTLED}
