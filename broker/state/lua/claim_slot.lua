-- claim_slot: decide one slot of a schedule, once: the beat's release of a slot, its miss, or a run-now.
-- KEYS[1] schedules HASH member -> JSON schedule
-- KEYS[2] schedule-cursors HASH member -> the last slot decided
-- KEYS[3] schedules-due ZSET member -> when the beat next looks at it
-- KEYS[4] schedule-runs:<member> HASH slot -> JSON run
-- KEYS[5] schedule-run-slots:<member> ZSET slot -> slot
-- KEYS[6] schedule-runs-releasing ZSET 'member|slot' -> when its release was sent
-- KEYS[7] schedule-runs-held ZSET 'member|slot' -> when the beat looks at it again
-- KEYS[8] schedule-stats HASH 'member|<what>' -> running totals
-- ARGV[1] member, ARGV[2] JSON {revision, slot (null: only `next_due`), status, run (the run's JSON text),
--   next_due (null: leave it), runs_kept, now, manual}
-- Returns {CLAIM.CLAIMED} once per slot; {CLAIM.DUPLICATE, run JSON or false} for a slot decided already
-- (a second beat, a pass run again, a failover that lost the beat's memory but not Redis's);
-- {CLAIM.STALE} when the schedule changed since the caller read it (revision), {CLAIM.GONE} when it was
-- deleted, {CLAIM.PAUSED} when paused; {CLAIM.RESCHEDULED} for a call without a slot.
-- A beat's slot is claimed only after the last one decided (the cursor), so a slot is never released
-- twice however many beats or messages ask; a run-now's (`manual`) only when that slot has no run.
-- KEYS by name (the positions above are the callers' contract).
local K = {schedules = KEYS[1], cursors = KEYS[2], due = KEYS[3], runs = KEYS[4], run_slots = KEYS[5],
           releasing = KEYS[6], held = KEYS[7], stats = KEYS[8]}
local member = ARGV[1]
local options = cjson.decode(ARGV[2])
local stored = redis.call('HGET', K.schedules, member)
if not stored then
  return {CLAIM.GONE}
end
local schedule = cjson.decode(stored)
if tonumber(schedule['revision']) ~= tonumber(options['revision']) then
  return {CLAIM.STALE}
end
local manual = options['manual'] == true
if schedule['paused'] == true and not manual then
  return {CLAIM.PAUSED}
end
local next_due = options['next_due']
if options['slot'] == nil or options['slot'] == cjson.null then
  if next_due ~= nil and next_due ~= cjson.null then
    redis.call('ZADD', K.due, next_due, member)
  end
  return {CLAIM.RESCHEDULED}
end
local slot = tonumber(options['slot'])
local field = string.format('%d', slot)
if manual then
  if redis.call('HEXISTS', K.runs, field) == 1 then
    return {CLAIM.DUPLICATE, redis.call('HGET', K.runs, field)}
  end
else
  local cursor = tonumber(redis.call('HGET', K.cursors, member))
  if cursor ~= nil and slot <= cursor then
    return {CLAIM.DUPLICATE, redis.call('HGET', K.runs, field) or false}
  end
  redis.call('HSET', K.cursors, member, field)
  if next_due ~= nil and next_due ~= cjson.null then
    redis.call('ZADD', K.due, next_due, member)
  end
end
local run_id = member .. '|' .. field
local now = tonumber(options['now'])
redis.call('HSET', K.runs, field, options['run'])
redis.call('ZADD', K.run_slots, slot, field)
if options['status'] == 'releasing' then
  redis.call('ZADD', K.releasing, now, run_id)
elseif options['status'] == 'held' then
  redis.call('ZADD', K.held, now, run_id)
elseif options['status'] == 'missed' then
  redis.call('HINCRBY', K.stats, member .. '|missed', 1)
end
local kept = tonumber(options['runs_kept'])
while redis.call('ZCARD', K.run_slots) > kept do
  local oldest = redis.call('ZPOPMIN', K.run_slots)[1]
  redis.call('HDEL', K.runs, oldest)
  redis.call('ZREM', K.releasing, member .. '|' .. oldest)
  redis.call('ZREM', K.held, member .. '|' .. oldest)
end
return {CLAIM.CLAIMED}
