-- The prefill slots of one GPU: cross-function admission by smallest deadline margin (DESIGN §7).
-- `slots` workers (1 by default) may run a prefill step at once. Margin of a waiter:
-- deadline - now - M * t, M = active batches on the GPU (the asker counted as one if it has none yet);
-- ties go to the smaller worker id. lorafn.runtime.slo.pick is the reference.
-- A freed slot is handed straight to the best waiter (its holder entry flagged `handoff`, a token pushed
-- on its wake list): a waiter blocked on that list starts at once instead of polling.
-- KEYS: 1 holders hash (worker -> until|handoff), 2 waiting hash (worker -> deadline|t|expires|lease|fn),
--       3 active zset (worker -> last active ms), 4 admissions stream (grants, capped: worker, function,
--       margin_ms, active, waiters, runner_up_ms = the next smallest margin among the waiters),
--       5 wake-list key prefix (+ worker id: the list a waiting worker blocks on)
-- ARGV: 1 op, 2 worker id, then per op:
--   ask:     3 function, 4 deadline (unix ms), 5 t (ms), 6 lease (ms), 7 waiter ttl (ms), 8 active ttl (ms),
--            9 slots
--            -> {1, margin, M, waiters}  granted (the slot is the asker's until released or the lease ends)
--            -> {0, margin, M, a holder or the waiter it went to, retry_ms}
--   release: 3 active ttl (ms), 4 slots -> 1 when the asker held a slot (now handed on or free), else 0
--   active:  3 active ttl (ms) -> M (the asker marked active)
--   idle:    3 active ttl (ms), 4 slots -> 1; the asker leaves the active set and the waiters, and hands
--            on its slot
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op = ARGV[1]
local worker = ARGV[2]

local function count_active(ttl, asker)
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - ttl)
  local m = redis.call('ZCARD', KEYS[3])
  if asker and not redis.call('ZSCORE', KEYS[3], asker) then
    m = m + 1
  end
  return m
end

-- the waiter of smallest margin (forgetting those that stopped asking), its entry, the runner-up's margin
local function best_waiter(active)
  local best, best_margin, best_entry, second, count = nil, nil, nil, nil, 0
  local all = redis.call('HGETALL', KEYS[2])
  for i = 1, #all, 2 do
    local w, entry = all[i], all[i + 1]
    local dl, tt, exp, lease, fn = string.match(entry, '^([^|]+)|([^|]+)|([^|]+)|([^|]+)|(.*)$')
    exp = tonumber(exp)
    if exp == nil or exp <= now then
      redis.call('HDEL', KEYS[2], w)
    else
      count = count + 1
      local m = tonumber(dl) - now - active * tonumber(tt)
      if best == nil or m < best_margin or (m == best_margin and w < best) then
        if best ~= nil then second = best_margin end
        best, best_margin, best_entry = w, m, {lease = tonumber(lease), fn = fn, expires = exp}
      elseif second == nil or m < second then
        second = m
      end
    end
  end
  return best, best_margin, best_entry, second, count
end

local function grant(w, entry, margin, active, second, count, handoff)
  -- handed on: the slot is the waiter's while it is still asking (until its waiter entry would expire)
  local hold = handoff == '1' and math.max(1, entry.expires - now) or entry.lease
  redis.call('HSET', KEYS[1], w, tostring(now + hold) .. '|' .. handoff)
  redis.call('PEXPIRE', KEYS[1], 60000)
  redis.call('HDEL', KEYS[2], w)
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', '1000', '*', 'worker', w, 'function', entry.fn,
    'margin_ms', tostring(margin), 'active', tostring(active), 'waiters', tostring(count),
    'runner_up_ms', second == nil and '' or tostring(second))
  if handoff == '1' then
    local wake = KEYS[5] .. w
    redis.call('LPUSH', wake, '1')
    redis.call('LTRIM', wake, 0, 0)
    redis.call('PEXPIRE', wake, hold)
  end
end

-- live holders (those whose lease ended are dropped), and the asker's `handoff` flag if it holds one
local function holders()
  local all = redis.call('HGETALL', KEYS[1])
  local n, mine, any = 0, nil, nil
  for i = 1, #all, 2 do
    local w = all[i]
    local u, flag = string.match(all[i + 1], '^([^|]+)|(.*)$')
    if tonumber(u) == nil or tonumber(u) <= now then
      redis.call('HDEL', KEYS[1], w) -- its holder died or hung: the lease ended
    else
      n = n + 1
      if w == worker then mine = flag else any = w end
    end
  end
  return n, mine, any
end

-- free slots go to the best waiters; returns the last one served
local function hand_on(ttl, slots, n)
  local active = count_active(ttl, nil)
  local last = nil
  while n < slots do
    local best, margin, entry, second, count = best_waiter(active)
    if best == nil then break end
    grant(best, entry, margin, active, second, count, '1')
    last = best
    n = n + 1
  end
  return last
end

local function release(ttl, slots)
  if redis.call('HEXISTS', KEYS[1], worker) == 1 then
    redis.call('HDEL', KEYS[1], worker)
    local n = holders()
    hand_on(ttl, slots, n)
    return 1
  end
  return 0
end

if op == 'release' then
  return release(tonumber(ARGV[3]), tonumber(ARGV[4]))
end
if op == 'idle' then
  redis.call('ZREM', KEYS[3], worker)
  redis.call('HDEL', KEYS[2], worker)
  release(tonumber(ARGV[3]), tonumber(ARGV[4]))
  return 1
end
if op == 'active' then
  local ttl = tonumber(ARGV[3])
  redis.call('ZADD', KEYS[3], now, worker)
  redis.call('PEXPIRE', KEYS[3], ttl * 10)
  return count_active(ttl, nil)
end
if op ~= 'ask' then
  return redis.error_reply('gpu_admission: unknown op ' .. tostring(op))
end

local fn = ARGV[3]
local deadline = tonumber(ARGV[4])
local t_ms = tonumber(ARGV[5])
local lease = tonumber(ARGV[6])
local waiter_ttl = tonumber(ARGV[7])
local active_ttl = tonumber(ARGV[8])
local active = count_active(active_ttl, worker)
local own = deadline - now - active * t_ms

local slots = tonumber(ARGV[9])

local n, mine, any = holders()
if mine == '1' then -- handed to this worker while it waited: take it
  redis.call('HSET', KEYS[1], worker, tostring(now + lease) .. '|0')
  redis.call('HDEL', KEYS[2], worker)
  return {1, tostring(own), active, 0}
end
redis.call('HSET', KEYS[2], worker, ARGV[4] .. '|' .. ARGV[5] .. '|' .. tostring(now + waiter_ttl) .. '|'
  .. tostring(lease) .. '|' .. fn)
redis.call('PEXPIRE', KEYS[2], waiter_ttl * 10)
if mine ~= nil then -- asking again after its own step: compete afresh (a long prefill does not keep it)
  redis.call('HDEL', KEYS[1], worker)
  n = n - 1
end
if n >= slots then
  return {0, tostring(own), active, any, 1}
end
local last = nil
while n < slots do
  local best, margin, entry, second, count = best_waiter(active)
  if best == nil then break end
  if best == worker then
    grant(worker, entry, margin, active, second, count, '0')
    return {1, tostring(own), active, count}
  end
  grant(best, entry, margin, active, second, count, '1')
  last = best
  n = n + 1
end
return {0, tostring(own), active, last or any or '', 1}
