-- head_company: what a model's head request has for company, for the dynamic batcher's wait.
-- KEYS[1] ready  ZSET item id -> score
-- KEYS[2] items  HASH item id -> payload
-- ARGV[1] most candidates to look at (the head included)
-- ARGV[2] rows that are enough (the count stops once it reaches them)
-- Returns: {} when the queue is empty or its head is not an online request; else
--          {rows, enqueued_at}: the rows of the waiting requests that could join the head's batch
--          (its shape bucket, among the first ARGV[1] waiting items, the head's own rows included;
--          counted up to ARGV[2]) and when the head was queued (a string, as stored).
-- KEYS by name (the positions above are the callers' contract).
local K = {ready = KEYS[1], items = KEYS[2]}
local candidates = redis.call('ZRANGE', K.ready, 0, tonumber(ARGV[1]) - 1)
if #candidates == 0 then
  return {}
end
local head = cjson.decode(redis.call('HGET', K.items, candidates[1]) or '{}')
if head['kind'] ~= 'request' then
  return {}
end
local rows = number_or(head['rows'], 1)
local enough = tonumber(ARGV[2])
for index = 2, #candidates do
  if rows >= enough then
    break
  end
  local item = cjson.decode(redis.call('HGET', K.items, candidates[index]) or '{}')
  if item['kind'] == 'request' and item['bucket'] == head['bucket'] then
    rows = rows + number_or(item['rows'], 1)
  end
end
return {rows, tostring((head['factors'] or {})['enqueued_at'] or 0)}
