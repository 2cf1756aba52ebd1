-- forget_chunks: take chunks whose output parts are gone (deleted with the job's output folder) out of a
-- stopped job's done set, so that its resume runs them again instead of a merge that can never succeed.
-- KEYS[1] job  HASH
-- KEYS[2] done SET  chunk indexes whose parts are written and acknowledged
-- ARGV[1..] pairs: chunk index, rows in that chunk
-- Returns: how many chunks were forgotten. Only a stopped job ('cancelled' or 'failed') is changed:
-- a running one may be in its merge, which removes parts once the outputs are whole.
-- KEYS by name (the positions above are the callers' contract).
local K = {job = KEYS[1], done = KEYS[2]}
local status = redis.call('HGET', K.job, 'status')
if status ~= 'cancelled' and status ~= 'failed' then
  return 0
end
local forgotten = 0
for i = 1, #ARGV, 2 do
  if redis.call('SREM', K.done, ARGV[i]) == 1 then
    redis.call('HINCRBY', K.job, 'chunks_done', -1)
    redis.call('HINCRBY', K.job, 'rows_done', -tonumber(ARGV[i + 1]))
    forgotten = forgotten + 1
  end
end
return forgotten
