-- lease_batch: move the best waiting items of one model's queue into its in-flight set (late binding).
-- KEYS[1] tickets   ZSET ticket id -> last seen
-- KEYS[2] ready     ZSET item id -> score
-- KEYS[3] inflight  ZSET item id -> lease deadline
-- KEYS[4] items     HASH item id -> payload
-- KEYS[5] attempts  HASH item id -> lease count
-- ARGV[1] ticket id ('' to lease without a ticket)
-- ARGV[2] now
-- ARGV[3] lease deadline
-- ARGV[4] most items in the batch
-- ARGV[5] most rows in the batch (merged online requests)
-- ARGV[6] most tokens in the batch (0: no limit), padded tokens for requests that will be padded
-- ARGV[7] most items when the head is a job chunk or finalize step
-- ARGV[8] '1': lease only online requests (a head that is a job chunk or finalize step stays, {0})
-- ARGV[9] '1' (ignored with ARGV[8]): when the head is a request and the batch has rows to spare, take the
--         first job chunk among the candidates, last (its rows fill the batch: the worker runs the
--         requests inside the chunk's first mini-batch)
-- ARGV[10] '1': a head request too must fit the row and token limits, else nothing is leased, {0}
--          (a batch cut to a memory hole must not outgrow it; a job chunk still goes: the row
--          limits are online batch limits, not its mini-batches'; the worker checks the chunk by
--          its own need and returns it if it does not fit, sits_worker/leasing.py `admitted`)
-- ARGV[11], ARGV[12] most rows and tokens (0: no token limit) of the whole batch, or '' for none: a
--          batch of requests formed under the limits above is leased only if it stays within these
--          (the head of the priority order, whose full batch does not fit: it runs now, if what
--          waits for it fits the free memory), else nothing, {0}. A job chunk at the head still goes.
-- ARGV[13] preferred batch sizes, comma-separated ('' for none): a batch of requests that takes no
--          job chunk along is cut to the largest preferred size its rows reach, its last requests
--          left waiting (Triton's preferred_batch_size; the head always stays).
-- Returns: {-1} when the ticket is no longer valid (a stale copy of a replaced ticket);
--          {0} when the queue is empty; else {n, id1, payload1, attempts1, ...}.
-- The head item always goes (but see ARGV[10]). Job chunks and finalize steps are taken in queue order up to
-- ARGV[7] (a worker runs them one by one); online requests are merged: later requests of the
-- same shape bucket join while the batch stays within its item, row and token budgets (those
-- that do not fit wait for the next batch).
-- With ARGV[9], the candidates are scanned past a full batch, looking for that chunk.
-- Items are never popped into the void: each one is in ready or in-flight at every instant.
if not ticket_valid(KEYS[1], ARGV[1], ARGV[2]) then
  return {-1}
end
local max_items, max_rows, max_tokens = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local max_chunks = tonumber(ARGV[7])
-- What a request costs against the token budget: its padded tokens (rows x length class) when it
-- will be padded to share a batch, else its own tokens.
local function token_cost(item)
  return number_or(item['padded_tokens'], number_or(item['tokens'], 0))
end
local candidates = redis.call('ZRANGE', KEYS[2], 0, 2 * math.max(max_items, max_chunks) - 1)
local carry = ARGV[9] == '1' and ARGV[8] ~= '1'
local picked, rows, tokens, bucket, online, carried = {}, 0, 0, nil, false, nil
for index, item_id in ipairs(candidates) do
  local payload = redis.call('HGET', KEYS[4], item_id) or '{}'
  local item = cjson.decode(payload)
  local is_request = item['kind'] == 'request'
  if index == 1 then
    if ARGV[8] == '1' and not is_request then
      return {0}
    end
    if ARGV[10] == '1' and is_request and (number_or(item['rows'], 1) > max_rows
        or (max_tokens > 0 and token_cost(item) > max_tokens)) then
      return {0}
    end
    picked[1] = {item_id, payload, number_or(item['rows'], 1), token_cost(item)}
    online = is_request
    bucket, rows, tokens = item['bucket'], number_or(item['rows'], 1), token_cost(item)
  elseif not online then
    if is_request or #picked >= max_chunks then
      break
    end
    picked[#picked + 1] = {item_id, payload}
  elseif #picked >= max_items and not (carry and carried == nil) then
    break
  elseif is_request and #picked < max_items and item['bucket'] == bucket
      and rows + number_or(item['rows'], 1) <= max_rows
      and (max_tokens == 0 or tokens + token_cost(item) <= max_tokens) then
    picked[#picked + 1] = {item_id, payload, number_or(item['rows'], 1), token_cost(item)}
    rows = rows + number_or(item['rows'], 1)
    tokens = tokens + token_cost(item)
  elseif carry and carried == nil and item['kind'] == 'chunk' then
    carried = {item_id, payload}
  end
end
if carried ~= nil and rows < max_rows then
  picked[#picked + 1] = carried
elseif online and (ARGV[13] or '') ~= '' then
  local cut = nil
  for size in string.gmatch(ARGV[13], '%d+') do
    if tonumber(size) <= rows and (cut == nil or tonumber(size) > cut) then
      cut = tonumber(size)
    end
  end
  while cut ~= nil and #picked > 1 and rows > cut do
    local last = table.remove(picked)
    rows, tokens = rows - last[3], tokens - last[4]
  end
end
if online and ARGV[11] ~= '' and (rows > tonumber(ARGV[11])
    or (tonumber(ARGV[12]) > 0 and tokens > tonumber(ARGV[12]))) then
  return {0}
end
local out = {#picked}
for _, entry in ipairs(picked) do
  redis.call('ZREM', KEYS[2], entry[1])
  redis.call('ZADD', KEYS[3], ARGV[3], entry[1])
  out[#out + 1] = entry[1]
  out[#out + 1] = entry[2]
  out[#out + 1] = redis.call('HINCRBY', KEYS[5], entry[1], 1)
end
return out
