-- complete_requests: store the results of a merged batch of online requests and wake their waiters.
-- KEYS[1] inflight   ZSET
-- KEYS[2] items      HASH
-- KEYS[3] attempts   HASH
-- KEYS[4] deadlines  ZSET
-- KEYS[5] ready      ZSET
-- KEYS[6] counters   HASH running totals for /metrics: 'requests_<status>:<model ref>' counts the
--           requests completed here, by status: succeeded, failed, or expired (its hash was gone, so
--           no result could be stored); one HINCRBY a status present in the call
-- KEYS[7..] for each request in order: its HASH, then its done LIST (a waiter BLPOPs it and gets the
--           finished request's fields as one JSON object, so it needs no second read)
-- ARGV[1] now, ARGV[2] seconds results are kept, ARGV[3] size of the batch (requests, plus job rows
-- when it shared a run with a job), ARGV[4] worker, ARGV[5] rows of offline jobs that shared the run,
-- ARGV[6] the requests' model ref (a batch is of one model)
-- ARGV[7..] for each request: item id, status ('succeeded' | 'failed'), outputs JSON, error text, error code
-- Returns: how many requests were completed.
-- A request gets one result: one that is waiting again (its lease expired and the reaper put it
-- back: it will run again) or already completed (no payload left) is skipped, so a late or
-- repeated completion from a worker that lost its lease changes nothing.
local done, by_status = 0, {}
for i = 0, (#ARGV - 6) / 5 - 1 do
  local item_id, status = ARGV[7 + 5 * i], ARGV[8 + 5 * i]
  local request, waiters = KEYS[7 + 2 * i], KEYS[8 + 2 * i]
  local held = redis.call('HEXISTS', KEYS[2], item_id) == 1 and not redis.call('ZSCORE', KEYS[5], item_id)
  if held then
    redis.call('ZREM', KEYS[1], item_id)
    redis.call('HDEL', KEYS[2], item_id)
    redis.call('HDEL', KEYS[3], item_id)
    redis.call('ZREM', KEYS[4], item_id)
  end
  if held and redis.call('EXISTS', request) == 1 then
    redis.call('HSET', request, 'status', status, 'outputs', ARGV[9 + 5 * i], 'error', ARGV[10 + 5 * i],
      'error_code', ARGV[11 + 5 * i], 'finished_at', ARGV[1], 'batch_size', ARGV[3], 'worker', ARGV[4],
      'job_rows', ARGV[5])
    redis.call('HDEL', request, 'inputs')
    redis.call('EXPIRE', request, ARGV[2])
    local flat, fields = redis.call('HGETALL', request), {}
    for j = 1, #flat, 2 do
      fields[flat[j]] = flat[j + 1]
    end
    redis.call('RPUSH', waiters, cjson.encode(fields))
    redis.call('EXPIRE', waiters, ARGV[2])
    done = done + 1
    by_status[status] = (by_status[status] or 0) + 1
  elseif held then  -- its hash expired before it ran (result_ttl): no one can read a result any more
    by_status['expired'] = (by_status['expired'] or 0) + 1
  end
end
for status, count in pairs(by_status) do
  redis.call('HINCRBY', KEYS[6], 'requests_' .. status .. ':' .. ARGV[6], count)
end
return done
