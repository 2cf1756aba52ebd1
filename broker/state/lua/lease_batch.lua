-- lease_batch: move the best waiting batch of one model's queue into its in-flight set (late binding).
-- KEYS[1] tickets   ZSET ticket id -> last seen
-- KEYS[2] ready     ZSET item id -> score, and its tenants' indexes beside it (lib.lua's `tenant_index`)
-- KEYS[3] inflight  ZSET item id -> lease deadline
-- KEYS[4] items     HASH item id -> payload
-- KEYS[5] attempts  HASH item id -> lease count
-- KEYS[6] doorbell  LIST idle drain loops block on: rung when a lease leaves work waiting, so that an
--           idle peer takes the next batch (snapshots empty the list: queue_snapshot.lua)
-- KEYS[7] waiting requests ZSET the model's online requests not leased (leased ones leave it)
-- KEYS[8] served    HASH tenant -> when its requests of the model were last answered, or until when a lease
--           keeps them present (`shares`)
-- ARGV[1] ticket id ('' for none); ARGV[2] now; ARGV[3] lease deadline; ARGV[4] options, a JSON object:
--   max_items, max_rows, max_tokens (0: no limit): budget of a batch of requests of the head's shape
--     bucket; tokens are padded tokens for requests that will be padded
--   max_chunks: most items when the head is a job chunk or finalize step (taken in queue order)
--   merge_rows (0 or absent: no such limit): a run unit (broker/jobs/granularity.py): the head chunk takes
--     further chunks of its own tenant along, in queue order, only while their rows and its own stay within
--     it, and no finalize step (the worker runs them in shared mini-batches, where one tenant's rows that
--     crash a run would cost another's chunks their attempts); a finalize step at the head goes alone
--   requests_only: lease only online requests (a chunk or finalize step at the head stays: {0})
--   carry_chunk (ignored with requests_only): a batch of requests with rows to spare also takes the
--     first job chunk among the candidates, last (the worker runs the requests in its first mini-batch)
--   head_must_fit: a head request too must fit max_rows and max_tokens, else {0}
--   batch_limit {rows, tokens (0: no limit)}, optional: a batch of requests goes only within it, else {0}
--   preferred_sizes [...]: a batch of requests without a chunk is cut to the largest size its rows reach
--   tenants {order [...], held [...], window}, optional (fair share, broker/tenants/shares.py): the waiting
--     items are weighed by tenant instead, the items (payload `tenant`) of tenants in `order` first (queue
--     order within a tenant), those of tenants not in it after; a held tenant's items are not leased at all
--     (it is past its limit; with nothing else waiting, the slot stays idle); with `only`, neither are the
--     items of tenants not in `order`. The ranked tenants' items are read from their own indexes (lib.lua's
--     `tenant_index`), however deep the queue holds them; the tenants not in `order` are looked for in the
--     first `window` items only. What a lease reads: the first-ranked tenants' first items, until twice the
--     batch's most items (2 x max(max_items, max_chunks): `enough`) are found, a ZRANGE per page of a ranked
--     tenant's index, and per item a ZSCORE and (per job, or per request) a payload decode; then the window
--     from the head only while fewer were found and another tenant's item waits (the indexes' ZCARDs add up
--     to less than the queue's), and only until `enough` are found. A requests-only lease reads the waiting
--     requests by level (K.waiting) in the window's place. At most `window` index entries and `window`
--     queue items in all. Until the model's index is built (a queue stored before it,
--     `broker.queueing.tenant_index`) only the window is weighed: a ranked tenant's items past it wait
--   shares {ranked [{tenant, share}], present_for, in_flight_for}, optional (a batch's rows by shares,
--     broker/tenants/batch_shares.py): a batch headed by a request of the first ranked tenant present on the
--     model (work waiting, or served within present_for; its requests go first) gives every other tenant at
--     most its share's part of that tenant's rows (none without a share); with that tenant present but
--     nothing of it waiting, nothing is leased ({LEASE.HELD_FOR_SHARE}); leased requests' tenants are marked
--     leased until in_flight_for from now (present while the batch runs; the answer takes the mark back, and
--     marks them served only if they ran: lib.lua's `mark_answered`)
--   request_prefix: the key prefix of request hashes (`keys.request('')`): each leased request's inputs
--     come back with it
--   classes {ranks [16], demote [16], window}, optional (a degraded worker, broker/failures/degrade.py): an item
--     submitted at level L (factors base_level, else level) ranks ranks[L+1] (1 first; 0: not leased,
--     its class is paused), by its score plus demote[L+1] within a rank; with `tenants` too, the
--     classes rank first, the tenants within a class; when the queue is longer than the window, the
--     first requests by level (K.waiting, the paused class last) are weighed too, wherever they wait
-- Returns {LEASE.STALE_TICKET}: the ticket is no longer valid; {LEASE.AT_SLOT_CAP}: nothing leased, and chunks
-- of jobs at their slot cap were within reach; {LEASE.ONLY_PAUSED}: nothing leased, and
-- paused items were all there was within reach (no held tenant's among them: a held tenant's wait ends
-- by the milliseconds, a paused class's by a step back); {LEASE.HELD_FOR_SHARE}: nothing leased, see
-- `shares`; {LEASE.NOTHING}: nothing leased; else {n, id1, payload1, attempts1, inputs1, ...}; after any of
-- the last four, how many online requests past their `reject` timeout (payload `expires_at`) the lease left
-- where they wait (it never leases them, nor counts them as their tenant's work: the caller fails them,
-- `broker.online.timeouts`), the tenant a HELD_FOR_SHARE was held for ('' otherwise: the caller charges it
-- the wait), then the names of the ranked tenants (`tenants.order`) a fair scan that read every item within
-- reach found nothing of (the caller may leave them out of its next orders a moment).
-- The head always goes, but see head_must_fit and batch_limit (a job chunk at the head ignores both).
-- A chunk of a job whose chunks hold its slot cap already (payload `max_slots`, lib.lua's `chunk_slot_cap`)
-- is not leased: the work behind it is.
-- Items are never popped into the void: each one is in ready or in-flight at every instant.
-- KEYS by name (K.ready ...), and each candidate and picked item a table of named fields ({id, payload,
-- item, rank, score, tenant}; {id, payload, rows, tokens, req, tenant}).
local K = {tickets = KEYS[1], ready = KEYS[2], inflight = KEYS[3], items = KEYS[4], attempts = KEYS[5],
  doorbell = KEYS[6], waiting = KEYS[7], served = KEYS[8]}
local ticket, now, lease_deadline, options = ARGV[1], ARGV[2], ARGV[3], cjson.decode(ARGV[4])
if not ticket_valid(K.tickets, ticket, now) then
  return {LEASE.STALE_TICKET}
end
local max_items, max_rows, max_tokens = options.max_items, options.max_rows, options.max_tokens
local max_chunks = options.max_chunks
local merge_rows = tonumber(options.merge_rows) or 0
local requests_only = options.requests_only == true
local carry = options.carry_chunk == true and not requests_only

-- What a request costs against the token budget: its padded tokens (rows x length class) when it
-- will be padded to share a batch, else its own tokens.
local function token_cost(item)
  return number_or(item['padded_tokens'], number_or(item['tokens'], 0))
end

-- Requests past their `reject` timeout the candidates left out (lib.lua's `request_expired`): the reply
-- counts them, and the caller fails them (expire_requests.lua) instead of waiting for the reaper's pass.
local expired_seen = 0
local function passed_timeout(item)
  if request_expired(item, now) then
    expired_seen = expired_seen + 1
    return true
  end
  return false
end

-- Slot caps (lib.lua's `chunk_slot_cap`): a job whose chunks already hold its `max_slots` leases gets no
-- more from this call. Per job, this call's view: {cap, held}, `held` counting what the batch takes too.
local slot_caps = {}
local function job_full(item)
  local cap = chunk_slot_cap(item)
  if cap == nil then
    return false
  end
  local state = slot_caps[item['job']]
  if state == nil then
    state = {cap = cap, held = job_slots_held(K.inflight, item['job'])}
    slot_caps[item['job']] = state
  end
  return state.held >= state.cap
end

-- The job whose slot `item` takes, counted now, or nil for an item of no capped job.
local function take_job_slot(item)
  local state = chunk_slot_cap(item) and slot_caps[item['job']]
  if not state then
    return nil
  end
  state.held = state.held + 1
  return item['job']
end

-- The rank of the last chunk of `job` in the run that starts at rank `first` with `score` (its chunks of one
-- score wait side by side, for members of equal score sort by id): found in O(log run) single-item reads.
local function run_end(first, job, score)
  local prefix = job .. ':c'
  local function in_run(rank)
    local found = redis.call('ZRANGE', K.ready, rank, rank, 'WITHSCORES')
    return #found == 2 and found[2] == score and string.sub(found[1], 1, #prefix) == prefix
  end
  local last, step = first, 1
  while in_run(last + step) do
    last, step = last + step, step * 2
  end
  local low, high = last, last + step - 1
  while low < high do
    local middle = math.floor((low + high + 1) / 2)
    if in_run(middle) then
      low = middle
    else
      high = middle - 1
    end
  end
  return low
end

-- The batch from the front of the queue: {id, payload, rows, tokens} each, whether the head is an
-- online request, the chunk to carry (or nil), the rows and tokens of the requests; nil: lease nothing.
-- Chunks follow a chunk head; requests of the head's bucket join a request head while they fit.
-- With carry, the scan goes on past a full batch, looking for that chunk.
-- A run of chunks of a job at its slot cap is stepped over, so the work behind it is reached however many
-- chunks the capped job has waiting. A job at its cap holds at least one in-flight lease, so one more run
-- than the in-flight set holds (at least MOST_CAPPED_RUNS) lets no number of capped jobs hide the work behind.
local MOST_CAPPED_RUNS = 16
local function queue_candidates()
  local want = 2 * math.max(max_items, max_chunks)
  local out, position, runs_skipped = {}, 0, 0
  local most_runs = math.max(MOST_CAPPED_RUNS, redis.call('ZCARD', K.inflight) + 1)
  repeat
    local page = redis.call('ZRANGE', K.ready, position, position + want - 1, 'WITHSCORES')
    local jumped = false
    for pair = 1, #page, 2 do
      local item_id = page[pair]
      local payload = redis.call('HGET', K.items, item_id) or '{}'
      local item = cjson.decode(payload)
      if job_full(item) then
        position = run_end(position, item['job'], page[pair + 1]) + 1
        runs_skipped, jumped = runs_skipped + 1, true
        break
      end
      position = position + 1
      if not passed_timeout(item) then
        out[#out + 1] = {id = item_id, payload = payload, item = item, tenant = item_tenant(item)}
      end
    end
  until not jumped or #out >= want or runs_skipped >= most_runs
  return out
end

-- The candidates by rank (fair share, degraded classes): waiting items by their rank (`ranking`), queue
-- order within a rank (score order, demotions included, with `classes`), the items no rank admits left
-- out. The ranked tenants' first items come from their own indexes (`read_ranked_heads`); the queue is read
-- in pages from its head, at most `window` items deep, only for what they leave to find, and no further once
-- enough items of the best possible rank are found: a flood of one tenant in front costs little, wherever the
-- first-ranked tenant's work waits. A job's chunks share its tenant and level, so their payloads are decoded
-- once per job, not once per chunk.
local FAIR_PAGE = 128
local fair_absent = {}  -- ranked tenants a full scan found no item of: told to the caller after the reply
local paused_seen = 0  -- items of a paused class in reach (the reply says when they were all there was)
local held_seen = 0  -- items of a held tenant in reach
local tenants_option = type(options.tenants) == 'table' and options.tenants or nil
local classes_option = type(options.classes) == 'table' and options.classes or nil
local shares_option = type(options.shares) == 'table' and options.shares or nil
local held_for_share = false  -- the share split held the batch back (the reply says so)
local held_by = ''  -- then, the tenant it was held for (its anchor)

-- When each ranked tenant of `shares` had its requests of the model last leased or answered (K.served),
-- read once per call.
local served_read = nil
local function served_at()
  if served_read == nil then
    served_read = served_times(K.served, shares_option)
  end
  return served_read
end

-- Is `tenant` present on the model by its requests served within `shares.present_for`? (A present tenant
-- is not told absent: its next request comes in a moment.)
local function recently_served(tenant)
  local at = shares_option and served_at()[tenant]
  return at ~= nil and tonumber(now) - at < shares_option.present_for
end

-- The `tenants` and `classes` options as one ranking: rank_of(tenant, level) is an item's rank (1 first),
-- or nil when it is not to be leased (a held tenant's; with `only`, a tenant's not in `order`; a paused
-- class's); demotion(level) what its score gains within its rank. Also returned: the best rank an item
-- can have (nil: none, every ranked tenant is held), the last rank, and the scan's depth.
local function ranking()
  local rank, held, last = {}, {}, 1
  local only = false
  if tenants_option then
    rank, held, last = tenant_ranks(tenants_option)
    only = tenants_option.only == true
  end
  local class_rank = classes_option and classes_option.ranks
  local demote = classes_option and classes_option.demote
  local function rank_of(tenant, level)
    if held[tenant] or (only and rank[tenant] == nil) then
      held_seen = held_seen + 1
      return nil
    end
    local band = class_rank and (tonumber(class_rank[level + 1]) or 1) or 1
    if band == 0 then
      paused_seen = paused_seen + 1
      return nil
    end
    return (band - 1) * last + (rank[tenant] or last)
  end
  local function demotion(level)
    return demote and (tonumber(demote[level + 1]) or 0) or 0
  end
  local best = nil
  if not tenants_option then
    best = 1
  end
  for index, name in ipairs(tenants_option and tenants_option.order or {}) do
    if not held[name] then
      best = index
      break
    end
  end
  local window = math.max(tonumber(tenants_option and tenants_option.window) or 0,
    tonumber(classes_option and classes_option.window) or 0)
  local bands = 1
  for _, band in ipairs(class_rank or {}) do
    bands = math.max(bands, tonumber(band) or 1)
  end
  return rank_of, demotion, best, bands * last, window
end

-- The level an item was submitted at (a PSA jump keeps it as `base_level`).
local function base_level(item)
  local factors = item['factors'] or {}
  return math.floor(number_or(factors['base_level'], number_or(factors['level'], 0)))
end

-- Entries {id, payload, item, rank, score, tenant} in rank order, then score, then id.
local function by_rank_then_score(a, b)
  if a.rank ~= b.rank then
    return a.rank < b.rank
  end
  if a.score ~= b.score then
    return a.score < b.score
  end
  return a.id < b.id
end

-- The first `count` waiting requests of the model by level (K.waiting, highest first), those in `skip`
-- left out, as entries {id, payload, item, rank, score}, demotion included; `seen` gains their tenants.
-- The requests no rank admits are left out.
local function requests_by_level(rank_of, demotion, count, skip, seen)
  local entries = {}
  for _, item_id in ipairs(redis.call('ZREVRANGE', K.waiting, 0, count - 1)) do
    local score = not skip[item_id] and redis.call('ZSCORE', K.ready, item_id)
    if score then
      local payload = redis.call('HGET', K.items, item_id) or '{}'
      local item = cjson.decode(payload)
      local level = base_level(item)
      local tenant = item_tenant(item)
      local live = not passed_timeout(item)
      seen[tenant] = seen[tenant] or live
      local item_rank = live and rank_of(tenant, level) or nil
      if item_rank ~= nil then
        entries[#entries + 1] = {id = item_id, payload = payload, item = item, rank = item_rank,
          score = tonumber(score) + demotion(level), tenant = tenant}
      end
    end
  end
  return entries
end

-- The requests the scan of `ranked_candidates` did not reach, added to its buckets: the first `enough`
-- by level, whatever the queue holds in front of them. Called for a degraded worker when the window ran
-- out before the queue did, so that a window full of paused work does not hide the requests behind it
-- (a job's chunks that far back stay unseen until the work in front of them goes).
local function add_unreached_requests(rank_of, demotion, by_rank, collected, seen, enough)
  for _, entry in ipairs(requests_by_level(rank_of, demotion, enough, collected, seen)) do
    local bucket = by_rank[entry.rank] or {}
    by_rank[entry.rank] = bucket
    bucket[#bucket + 1] = entry
  end
end

-- The ranked tenants' heads from their own indexes (lib.lua's `tenant_index`), so that a ranked tenant's work
-- is found however deep the queue holds it; nil while the model's indexes are not built (a queue stored before
-- them: the window alone is weighed). Walks `tenants.order`, held tenants skipped, reading each one's waiting
-- items in queue order, in pages, and handing each to `take(item_id, score)` (true: it counts), until the
-- tenant has `per_tenant` counted, none left, or `tenant_most` of its entries read (nil: no bound); the walk
-- ends once `want` counted in all, or `most` entries were read. An entry whose item no longer waits (left by
-- a process of an older version) is dropped. Returns {counted, walked_all (every ranked tenant was read to its
-- end or its `per_tenant`), empty (the ranked tenants with nothing waiting)}.
local function read_ranked_heads(take, want, per_tenant, most, tenant_most)
  if tenants_option == nil or not tenant_index_built(K.ready) then
    return nil
  end
  local _, held = tenant_ranks(tenants_option)
  local heads = {counted = 0, walked_all = true, empty = {}}
  local budget = most
  for _, name in ipairs(tenants_option.order or {}) do
    if heads.counted >= want or budget <= 0 then
      heads.walked_all = false
      break
    end
    if not held[name] then
      local index_key = tenant_index(K.ready, name)
      local offset, live, counted, ended = 0, 0, 0, false
      local reads = math.min(budget, tenant_most or budget)  -- (what this tenant's entries may take)
      budget = budget - reads
      while counted < per_tenant and reads > 0 do
        -- (pages as long as what is still wanted: a tenant's own entries mostly count, its chunks for a
        -- requests-only lease do not, so at least 16)
        local asked = math.min(FAIR_PAGE, reads, math.max(per_tenant - counted, 16))
        local page = redis.call('ZRANGE', index_key, offset, offset + asked - 1, 'WITHSCORES')
        for pair = 1, #page, 2 do
          local item_id = page[pair]
          reads = reads - 1
          if redis.call('ZSCORE', K.ready, item_id) then
            live, offset = live + 1, offset + 1
            if take(item_id, tonumber(page[pair + 1])) then
              counted = counted + 1
              if counted >= per_tenant then
                break
              end
            end
          else
            redis.call('ZREM', index_key, item_id)  -- (the next entries move up: the offset stays)
          end
        end
        if #page < 2 * asked then
          ended = true
          break
        end
      end
      budget = budget + reads  -- (what it left)
      heads.counted = heads.counted + counted
      if not ended and counted < per_tenant then  -- (its reads ran out first)
        heads.walked_all = false
      end
      if ended and live == 0 then
        heads.empty[#heads.empty + 1] = name
      end
    end
  end
  return heads
end

-- How many ranked items end the walk of the ranked tenants' indexes: `enough` fill any batch; with `shares`,
-- every ranked tenant's head is read, since each present one takes part in a batch's share split.
local function heads_wanted(enough)
  return shares_option and math.huge or enough
end

-- Does every waiting item belong to a tenant of `tenants.order` or `tenants.held`? (Their indexes' sizes add
-- up to the queue's: then a walk of every ranked tenant's index has found all a lease may take.)
local function only_ranked_waiting()
  local total, counted = 0, {}
  for _, names in ipairs({tenants_option.order or {}, tenants_option.held or {}}) do
    for _, name in ipairs(names) do
      if not counted[name] then
        counted[name] = true
        total = total + redis.call('ZCARD', tenant_index(K.ready, name))
      end
    end
  end
  return total == redis.call('ZCARD', K.ready)
end

-- Do the ranked tenants' heads (`read_ranked_heads`) hold the batch, so that the window need not be read?
-- They do with `want` items that rank (whatever the window holds ranks after them), and when every ranked
-- tenant was read to its end and nothing else may be leased (`only`, or no other tenant's item waits). Not
-- for a degraded worker, whose classes may rank a window's item first.
local function heads_hold(heads, want)
  if heads == nil or classes_option then
    return false
  end
  return heads.counted >= want or (heads.walked_all and (tenants_option.only == true or only_ranked_waiting()))
end

local function ranked_candidates()
  local rank_of, demotion, best_possible, last, window = ranking()
  local enough = 2 * math.max(max_items, max_chunks)
  window = math.max(window, enough)
  local job_facts, by_rank, found_best, position, full_rank, seen = {}, {}, 0, 0, last, {}
  local collected = {}  -- item id -> true, of every item the scan read
  local ranked_total = 0  -- items read that rank (some leasable)
  local stopped_early, read_all = false, false
  -- Weigh one waiting item into its rank's bucket; true when it ranks.
  local function weigh(item_id, score)
    collected[item_id] = true
    local cut = string.find(item_id, ':c', 1, true)  -- (a chunk's id: '<job>:c<index>'; a plain find)
    local job = cut and string.sub(item_id, 1, cut - 1)
    local facts = job and job_facts[job]
    local payload, item = nil, nil
    if facts == nil then
      payload = redis.call('HGET', K.items, item_id) or '{}'
      item = cjson.decode(payload)
      if passed_timeout(item) then
        return false
      end
      facts = {tenant = item_tenant(item), level = base_level(item), full = job_full(item)}
      if job then
        job_facts[job] = facts
      end
    end
    local tenant, level = facts.tenant, facts.level
    seen[tenant] = true
    if facts.full then  -- (its job holds its slot cap: none of its chunks is leased now)
      return false
    end
    local item_rank = rank_of(tenant, level)
    if item_rank == nil then
      return false
    end
    ranked_total = ranked_total + 1
    -- (past a rank with enough items already, a worse one's items would never be reached, nor its own
    -- without demotions, which may reorder a rank; but with `shares` each present tenant's take part)
    if item_rank <= full_rank or shares_option then
      if item_rank == best_possible then
        found_best = found_best + 1
      end
      local bucket = by_rank[item_rank]
      if bucket == nil then
        bucket = {}
        by_rank[item_rank] = bucket
      end
      if #bucket < enough or classes_option then
        bucket[#bucket + 1] = {id = item_id, payload = payload, item = item, rank = item_rank,
          score = score + demotion(level), tenant = tenant}
        if #bucket >= enough and item_rank < full_rank then
          full_rank = item_rank
        end
      end
    end
    return true
  end
  -- The ranked tenants' own heads first: a ranked tenant's bucket holds its first items in queue order, so the
  -- window after them adds its later ones (or none: it is full) and the unranked tenants' items.
  local heads = read_ranked_heads(weigh, heads_wanted(enough), enough, window)
  local held_by_heads = heads_hold(heads, enough)
  while position < window and not held_by_heads do
    local asked = math.min(position + FAIR_PAGE, window) - position
    local page = redis.call('ZRANGE', K.ready, position, position + asked - 1, 'WITHSCORES')
    for pair = 1, #page, 2 do
      local item_id = page[pair]
      position = position + 1
      if not collected[item_id] then
        weigh(item_id, tonumber(page[pair + 1]))
      end
    end
    if best_possible ~= nil and found_best >= enough then
      stopped_early = true
      break
    end
    -- (every ranked tenant's items read from its index: the window adds only unranked ones, which go after)
    if heads ~= nil and heads.walked_all and not classes_option and ranked_total >= enough then
      stopped_early = true
      break
    end
    if #page < 2 * asked then  -- (the queue ended within the page)
      read_all = true
      break
    end
  end
  if classes_option and not stopped_early and not read_all then  -- (the window ran out first)
    add_unreached_requests(rank_of, demotion, by_rank, collected, seen, enough)
  end
  if heads ~= nil then  -- the indexes say which ranked tenants have nothing waiting, however deep the queue
    for _, name in ipairs(heads.empty) do
      if not recently_served(name) then
        fair_absent[#fair_absent + 1] = name
      end
    end
  elseif not stopped_early and tenants_option then  -- every item looked at: the ranked tenants not seen have none
    local _, held = tenant_ranks(tenants_option)
    for _, name in ipairs(tenants_option.order or {}) do
      if not seen[name] and not held[name] and not recently_served(name) then
        fair_absent[#fair_absent + 1] = name
      end
    end
  end
  local out = {}  -- (by rank, queue order within one: buckets, not a sort, unless demotions or added
  for item_rank = 1, last do  -- requests reorder them, both a degraded worker's)
    local bucket = by_rank[item_rank] or {}
    if classes_option then
      table.sort(bucket, by_rank_then_score)
    end
    for _, entry in ipairs(bucket) do
      out[#out + 1] = entry
    end
  end
  return out
end

-- The candidates of a requests-only lease by rank: the model's waiting online requests (K.waiting, at most
-- `window` of them, the highest levels first), not the whole queue, which may hold thousands of chunks in
-- front of them, and the ranked tenants' first requests from their own indexes (`read_ranked_heads`), however
-- many wait before them; by rank, then by score (demotions included) within a rank; the requests no rank
-- admits left out.
local function ranked_requests()
  local rank_of, demotion, _, _, window = ranking()
  local enough = 2 * max_items
  window = math.max(window, enough)
  local entries, collected = {}, {}
  -- A ranked tenant's waiting item from its index: true when it is a request that ranks.
  local function take(item_id, score)
    if string.find(item_id, ':c', 1, true) then  -- (a job's chunk: not read)
      return false
    end
    local payload = redis.call('HGET', K.items, item_id) or '{}'
    local item = cjson.decode(payload)
    if item['kind'] ~= 'request' then
      return false
    end
    collected[item_id] = true
    if passed_timeout(item) then
      return false
    end
    local level = base_level(item)
    local item_rank = rank_of(item_tenant(item), level)
    if item_rank == nil then
      return false
    end
    entries[#entries + 1] = {id = item_id, payload = payload, item = item, rank = item_rank,
      score = score + demotion(level), tenant = item_tenant(item)}
    return true
  end
  -- (a tenant's requests among its own job's chunks: past a page of them, the waiting requests by level find
  -- them, as without the indexes)
  if not heads_hold(read_ranked_heads(take, heads_wanted(enough), enough, window, FAIR_PAGE), enough) then
    for _, entry in ipairs(requests_by_level(rank_of, demotion, window, collected, {})) do
      entries[#entries + 1] = entry
    end
  end
  table.sort(entries, by_rank_then_score)
  return entries
end

-- Tenant -> how many of the candidates are its.
local function waiting_by_tenant(candidates)
  local waiting = {}
  for _, candidate in ipairs(candidates) do
    waiting[candidate.tenant] = (waiting[candidate.tenant] or 0) + 1
  end
  return waiting
end

-- The candidates of a batch of requests with the share split's anchor's requests first, each in its order
-- (lib.lua's `share_anchor`): the fair order may leave a tenant out a moment (taken for absent), but while
-- present it ranks first in the full order. A chunk at the head stays there (the order alone decides
-- between chunks and requests), and so do a degraded worker's candidates (its classes rank first).
local function anchor_first(candidates)
  local head = candidates[1]
  if classes_option or head == nil or head.item == nil or head.item['kind'] ~= 'request' then
    return candidates
  end
  local anchor = share_anchor(shares_option, waiting_by_tenant(candidates), served_at(), tonumber(now))
  if anchor == nil or head.tenant == anchor then
    return candidates
  end
  local first, rest = {}, {}
  for _, candidate in ipairs(candidates) do
    if candidate.tenant == anchor and candidate.item ~= nil and candidate.item['kind'] == 'request' then
      first[#first + 1] = candidate
    else
      rest[#rest + 1] = candidate
    end
  end
  for _, candidate in ipairs(rest) do
    first[#first + 1] = candidate
  end
  return first
end

-- The share split of a batch headed by the request `candidates[1]` (lib.lua's `share_split`): the tenants
-- with items among the candidates, and the rows the head's tenant brings in the head's shape bucket.
local function batch_split(candidates)
  local head, head_tenant = candidates[1].item, candidates[1].tenant
  local waiting, anchor_rows = waiting_by_tenant(candidates), 0
  for _, candidate in ipairs(candidates) do
    local item = candidate.item
    if candidate.tenant == head_tenant and item ~= nil and item['kind'] == 'request'
        and item['bucket'] == head['bucket'] then
      anchor_rows = anchor_rows + number_or(item['rows'], 1)
    end
  end
  return share_split(shares_option, waiting, served_at(), head_tenant, math.min(anchor_rows, max_rows),
    tonumber(now))
end

-- May `tenant` add `item_rows` to the batch, having added `taken[tenant]` already?
local function within_share(split, taken, tenant, item_rows)
  local most = share_quota(split, tenant)
  return most == nil or (taken[tenant] or 0) + item_rows <= most
end

local function pick_candidates()
  if requests_only and redis.call('ZCARD', K.waiting) == 0 then
    return nil  -- (no online request waits: nothing to look for)
  end
  local candidates
  if (tenants_option or classes_option) and requests_only then
    candidates = ranked_requests()
  elseif tenants_option or classes_option then
    candidates = ranked_candidates()
  else
    candidates = queue_candidates()
  end
  local split = nil
  if shares_option then
    candidates = anchor_first(candidates)
  end
  local head = candidates[1]
  if shares_option and head ~= nil and head.item ~= nil and head.item['kind'] == 'request' then
    split = batch_split(candidates)
    if split ~= nil and split.hold then
      held_for_share, held_by = true, split.anchor
      return nil
    end
  end
  local picked, rows, tokens, bucket, online, carried = {}, 0, 0, nil, false, nil
  local taken = {}  -- tenant -> rows of its requests in the batch
  local unit_rows, head_chunk, head_tenant = 0, false, nil  -- rows of the chunks picked, against merge_rows
  for index, candidate in ipairs(candidates) do
    local item_id, payload, item = candidate.id, candidate.payload, candidate.item
    if payload == nil then  -- (a chunk whose tenant was known from its job's: read only if it is looked at)
      payload = redis.call('HGET', K.items, item_id) or '{}'
      item = cjson.decode(payload)
    end
    local is_request = item['kind'] == 'request'
    if index == 1 then
      if requests_only and not is_request then
        return nil
      end
      -- A batch cut to a memory hole must not outgrow it. A chunk still goes: these are online batch
      -- limits, not its mini-batches'; the worker checks it by its own need (sits_worker/serving/leasing.py).
      if options.head_must_fit == true and is_request and (number_or(item['rows'], 1) > max_rows
          or (max_tokens > 0 and token_cost(item) > max_tokens)) then
        return nil
      end
      picked[1] = {id = item_id, payload = payload, rows = number_or(item['rows'], 1), tokens = token_cost(item),
        req = item['req'], tenant = candidate.tenant, capped_job = take_job_slot(item)}
      taken[candidate.tenant] = number_or(item['rows'], 1)
      online = is_request
      bucket, rows, tokens = item['bucket'], number_or(item['rows'], 1), token_cost(item)
      unit_rows, head_chunk = number_or(item['stop'], 0) - number_or(item['start'], 0), item['kind'] == 'chunk'
      head_tenant = item['tenant'] or ''
    elseif not online then
      if is_request or #picked >= max_chunks then
        break
      end
      if merge_rows > 0 then  -- a run unit: only chunks, within its rows
        local chunk_rows = number_or(item['stop'], 0) - number_or(item['start'], 0)
        if item['kind'] ~= 'chunk' or not head_chunk or (item['tenant'] or '') ~= head_tenant
            or unit_rows + chunk_rows > merge_rows then
          break
        end
        if not job_full(item) then
          unit_rows = unit_rows + chunk_rows
        end
      end
      if not job_full(item) then  -- (a capped job's chunks fill the batch only up to its cap)
        picked[#picked + 1] = {id = item_id, payload = payload, tenant = candidate.tenant,
          capped_job = take_job_slot(item)}
      end
    elseif #picked >= max_items and not (carry and carried == nil) then
      break
    elseif is_request and #picked < max_items and item['bucket'] == bucket
        and rows + number_or(item['rows'], 1) <= max_rows
        and (max_tokens == 0 or tokens + token_cost(item) <= max_tokens)
        and within_share(split, taken, candidate.tenant, number_or(item['rows'], 1)) then
      picked[#picked + 1] = {id = item_id, payload = payload, rows = number_or(item['rows'], 1),
        tokens = token_cost(item), req = item['req'], tenant = candidate.tenant}
      taken[candidate.tenant] = (taken[candidate.tenant] or 0) + number_or(item['rows'], 1)
      rows = rows + number_or(item['rows'], 1)
      tokens = tokens + token_cost(item)
    elseif carry and carried == nil and item['kind'] == 'chunk' and share_quota(split, candidate.tenant) == nil then
      carried = {id = item_id, payload = payload, tenant = candidate.tenant, capped_job = take_job_slot(item)}
    end
  end
  return picked, online, carried, rows, tokens
end

-- Carry the chunk when the requests leave rows to spare; else cut a batch of requests to the
-- largest preferred size its rows reach (its last requests stay waiting; the head always stays).
-- Returns the rows and tokens left in the batch.
local function carry_or_cut(picked, online, carried, rows, tokens)
  if carried ~= nil and rows < max_rows then
    picked[#picked + 1] = carried
  elseif online then
    local cut = nil
    for _, size in ipairs(options.preferred_sizes or {}) do
      if size <= rows and (cut == nil or size > cut) then
        cut = size
      end
    end
    while cut ~= nil and #picked > 1 and rows > cut do
      local last = table.remove(picked)
      rows, tokens = rows - last.rows, tokens - last.tokens
    end
  end
  return rows, tokens
end

-- Does a batch of requests stay within batch_limit (a job chunk at the head always does)? The head
-- of the priority order, whose full batch does not fit, runs now if what waits for it fits free memory.
local function within_batch_limit(online, rows, tokens)
  local limit = options.batch_limit
  if not online or type(limit) ~= 'table' then
    return true
  end
  return not (rows > limit.rows or (limit.tokens > 0 and tokens > limit.tokens))
end

-- Move the picked items from ready to in-flight, counting a lease each; the reply.
local function move_to_inflight(picked)
  local out = {#picked}
  for _, entry in ipairs(picked) do
    ready_remove(K.ready, entry.id, entry.tenant)
    redis.call('ZADD', K.inflight, lease_deadline, entry.id)
    if entry.capped_job then
      note_job_slot(K.inflight, entry.capped_job, entry.id, lease_deadline)
    end
    redis.call('ZREM', K.waiting, entry.id)
    append_leased(out, entry.id, entry.payload, redis.call('HINCRBY', K.attempts, entry.id, 1),
      options.request_prefix or '', entry.req)
  end
  return out
end

-- The leased requests' tenants are present on the model while the batch runs (`shares`, lib.lua's
-- `mark_leased`): one HSET for the batch.
local function mark_served(picked)
  if shares_option == nil then
    return
  end
  local tenants = {}
  for _, entry in ipairs(picked) do
    if entry.req ~= nil then
      tenants[entry.tenant] = true
    end
  end
  mark_leased(K.served, tenants, now, shares_option)
end

-- The reply, with how many requests past their timeout were left out, the tenant the lease was held for,
-- then the ranked tenants a full fair scan found nothing of, after its items.
local function with_absent(reply)
  reply[#reply + 1] = expired_seen
  reply[#reply + 1] = held_by
  for _, name in ipairs(fair_absent) do
    reply[#reply + 1] = name
  end
  return reply
end

local picked, online, carried, rows, tokens = pick_candidates()
if held_for_share then
  return with_absent({LEASE.HELD_FOR_SHARE})
end
if picked == nil or #picked == 0 then  -- (empty: every item in the window is a held tenant's or paused)
  local why = LEASE.NOTHING
  if picked ~= nil and paused_seen > 0 and held_seen == 0 then
    why = LEASE.ONLY_PAUSED
  elseif picked ~= nil and next(slot_caps) ~= nil then  -- (only capped jobs' chunks were within reach)
    why = LEASE.AT_SLOT_CAP
  end
  return with_absent({why})
end
rows, tokens = carry_or_cut(picked, online, carried, rows, tokens)
if not within_batch_limit(online, rows, tokens) then
  return with_absent({LEASE.NOTHING})
end
local reply = move_to_inflight(picked)
mark_served(picked)
if redis.call('ZCARD', K.ready) > 0 then
  ring_doorbell(K.doorbell)
end
return with_absent(reply)
