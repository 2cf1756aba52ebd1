-- index_ready: one page of building the tenants' indexes of a ready queue stored before they existed (a fleet
-- upgraded with work waiting), so that fair-share leases find a ranked tenant's work however deep
-- (lib.lua's `tenant_index`). Run by reaper passes, a page each (`broker.queueing.tenant_index`).
-- KEYS[1] ready  ZSET item id -> score; beside it (names built from it, lib.lua) its tenants' indexes, the
--           `built` mark and the walk's ZSCAN cursor
-- KEYS[2] items  HASH item id -> payload (its `tenant`)
-- ARGV[1] ZSCAN COUNT: about how many entries this call indexes
-- Returns: 1 when the index is built (now or before), 0 while more pages are to come.
-- ZSCAN returns every member present for the whole walk at least once; each goes into its tenant's index
-- at its score in ready, which adds nothing twice. What is queued, leased, re-scored or taken out meanwhile,
-- every script keeps in the indexes already (lib.lua's `ready_add`, `ready_remove`), so the index holds
-- exactly the waiting items when the walk ends.
-- KEYS by name (the positions above are the callers' contract).
local K = {ready = KEYS[1], items = KEYS[2]}
local built, cursor_key = K.ready .. TENANT_INDEX_BUILT, K.ready .. TENANT_INDEX_CURSOR
if redis.call('EXISTS', built) == 1 then
  return 1
end
local scan = redis.call('ZSCAN', K.ready, redis.call('GET', cursor_key) or '0', 'COUNT', ARGV[1])
local entries, job_tenants = scan[2], {}  -- (a job's chunks share its tenant: one decode per job)
for pair = 1, #entries, 2 do
  local item_id = entries[pair]
  local cut = string.find(item_id, ':c', 1, true)  -- (a chunk's id: '<job>:c<index>')
  local job = cut and string.sub(item_id, 1, cut - 1)
  local tenant = job and job_tenants[job]
  if tenant == nil then
    local payload = redis.call('HGET', K.items, item_id)
    tenant = item_tenant(payload and cjson.decode(payload))
    if job then
      job_tenants[job] = tenant
    end
  end
  redis.call('ZADD', tenant_index(K.ready, tenant), entries[pair + 1], item_id)
end
if scan[1] == '0' then
  redis.call('SET', built, '1')
  redis.call('DEL', cursor_key)
  return 1
end
redis.call('SET', cursor_key, scan[1])
return 0
