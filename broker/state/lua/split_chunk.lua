-- split_chunk: a running chunk ends early at a row; the rest of its rows becomes a new chunk of its job, queued.
-- KEYS[1] items    HASH item id -> payload (the chunk's `stop` becomes the row; the new chunk's payload is added)
-- KEYS[2] inflight ZSET the model's leased items (the chunk must be among them)
-- KEYS[3] ready    ZSET the model's queue, with its tenants' indexes (lib.lua's `ready_add`)
-- KEYS[4] job      HASH the job (`chunks_total` counts the new chunk; it must be queued or running)
-- KEYS[5] cuts     HASH chunk index -> 'start,stop' of each chunk whose range is not the one the job's chunk
--          size gives (`broker/jobs/cuts.py`)
-- KEYS[6] queues   SET model refs with a queue, KEYS[7] its version; KEYS[8] doorbell LIST (rung: the new
--          chunk waits for any idle slot)
-- ARGV[1] the chunk's item id, ARGV[2] its start and ARGV[3] its stop as the caller ran it, ARGV[4] the row
-- it ends at (start < row < stop), ARGV[5] the model ref, ARGV[6] the new chunk's item id prefix ('<job>:c')
-- Returns {1, new chunk index}: split; {0, stop}: not split, the chunk's stop as stored (another run of the
-- chunk split it already, or it is not leased, its job stopped or gone: 0); one atomic step, so the job's
-- chunks tile its rows at every instant and a crash leaves no row without a chunk.
local K = {items = KEYS[1], inflight = KEYS[2], ready = KEYS[3], job = KEYS[4], cuts = KEYS[5], queues = KEYS[6],
  queues_version = KEYS[7], doorbell = KEYS[8]}
local item_id, start, stop, row = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local raw = redis.call('HGET', K.items, item_id)
if not raw then
  return {0, 0}
end
local payload = cjson.decode(raw)
local status = redis.call('HGET', K.job, 'status')
if tonumber(payload['start']) ~= start or tonumber(payload['stop']) ~= stop or not redis.call('ZSCORE', K.inflight, item_id)
    or (status ~= 'queued' and status ~= 'running') or not (start < row and row < stop) then
  return {0, tonumber(payload['stop'])}
end
local index = redis.call('HINCRBY', K.job, 'chunks_total', 1) - 1
redis.call('HSET', K.cuts, tostring(payload['chunk']), start .. ',' .. row, tostring(index), row .. ',' .. stop)
payload['stop'] = row
redis.call('HSET', K.items, item_id, cjson.encode(payload))
local rest = cjson.decode(raw)
rest['chunk'], rest['start'] = index, row
local rest_id = ARGV[6] .. string.format('%07d', index)
redis.call('HSET', K.items, rest_id, cjson.encode(rest))
ready_add(K.ready, rest_id, rest['score'], item_tenant(rest))
add_queue(K.queues, K.queues_version, ARGV[5], K.ready)
ring_doorbell(K.doorbell)
return {1, index}
