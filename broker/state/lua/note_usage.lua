-- note_usage: bill runs' device time to their tenants, for fair share and for chargeback, in one step.
-- KEYS[1] usage    HASH tenant -> JSON {value, at}: its decayed device-seconds (fair share ranks by it)
-- KEYS[2] billed   ZSET tenant -> last day billed (who GET /v1/usage lists)
-- KEYS[3] counters HASH running totals for /metrics ('tenant_device_us:<tenant>' in microseconds,
--           'tenant_rows:<tenant>')
-- KEYS[4..] bills  HASH per (tenant, day), one per entry of ARGV[4], in its order
-- ARGV[1] now, ARGV[2] usage half-life (seconds), ARGV[3] the day (unix day number)
-- ARGV[4] JSON list of entries {tenant, owner, model, device, seconds, rows, requests, queue_seconds, billed}
-- ARGV[5] seconds a bill is kept after its last change
-- Each entry adds to its tenant's decayed usage (decayed to now first: halved per half-life since
-- it was last noted) and, unless its `billed` is false, to its bill of the day: totals, and by model, key
-- and device kind.
-- Returns the number of entries billed.
-- KEYS by name (the positions above are the callers' contract).
local K = {usage = KEYS[1], billed = KEYS[2], counters = KEYS[3]}
local now, half_life, day = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local entries = cjson.decode(ARGV[4])
for index, entry in ipairs(entries) do
  local tenant, seconds = entry['tenant'], tonumber(entry['seconds']) or 0
  local stored = redis.call('HGET', K.usage, tenant)
  local value = 0
  if stored then
    local usage = cjson.decode(stored)
    local age = math.max(0, now - (tonumber(usage['at']) or now))
    value = (tonumber(usage['value']) or 0) * math.pow(2, -age / half_life)
  end
  redis.call('HSET', K.usage, tenant, cjson.encode({value = value + seconds, at = now}))
  if entry['billed'] ~= false then  -- (a charge for the ranking alone is on no bill: `BillEntry.billed`)
    redis.call('ZADD', K.billed, day, tenant)
    local bill = KEYS[3 + index]
    local rows, requests, queued = tonumber(entry['rows']) or 0, tonumber(entry['requests']) or 0,
      tonumber(entry['queue_seconds']) or 0
    redis.call('HINCRBY', K.counters, 'tenant_device_us:' .. tenant, math.floor(seconds * 1e6 + 0.5))
    redis.call('HINCRBY', K.counters, 'tenant_rows:' .. tenant, rows)
    redis.call('HINCRBYFLOAT', bill, 'device_seconds', seconds)
    redis.call('HINCRBY', bill, 'rows', rows)
    redis.call('HINCRBY', bill, 'requests', requests)
    redis.call('HINCRBYFLOAT', bill, 'queue_seconds', queued)
    redis.call('EXPIRE', bill, ARGV[5])
    for _, part in ipairs({'model:' .. entry['model'], 'key:' .. entry['owner'], 'device:' .. entry['device']}) do
      redis.call('HINCRBYFLOAT', bill, part .. ':device_seconds', seconds)
      redis.call('HINCRBY', bill, part .. ':rows', rows)
      redis.call('HINCRBY', bill, part .. ':requests', requests)
      redis.call('HINCRBYFLOAT', bill, part .. ':queue_seconds', queued)
    end
  end
end
return #entries
