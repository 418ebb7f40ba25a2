-- The prefill slot of one GPU: cross-function admission by smallest deadline margin (DESIGN §7).
-- Margin of a waiter: deadline - now - M * t, M = active batches on the GPU (the asker counted as one
-- if it has none yet); ties go to the smaller worker id. lorafn.runtime.slo.pick is the reference.
-- A free slot is handed straight to the best waiter (holder set, `handoff` flagged, a token pushed on
-- its wake list): a waiter blocked on that list starts at once instead of polling.
-- KEYS: 1 slot hash (holder, until, handoff), 2 waiting hash (worker -> deadline|t|expires|lease|function),
--       3 active zset (worker -> last active ms), 4 admissions stream (grants, capped: worker, function,
--       margin_ms, active, waiters, runner_up_ms = the next smallest margin among the waiters),
--       5 wake-list key prefix (+ worker id: the list a waiting worker blocks on)
-- ARGV: 1 op, 2 worker id, then per op:
--   ask:     3 function, 4 deadline (unix ms), 5 t (ms), 6 lease (ms), 7 waiter ttl (ms), 8 active ttl (ms)
--            -> {1, margin, M, waiters}  granted (the slot is the asker's until released or the lease ends)
--            -> {0, margin, M, holder, retry_ms}
--   release: 3 active ttl (ms) -> 1 when the asker held the slot (now handed on or free), else 0
--   active:  3 active ttl (ms) -> M (the asker marked active)
--   idle:    3 active ttl (ms) -> 1; the asker leaves the active set and the waiters, and hands on its slot
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
  redis.call('HSET', KEYS[1], 'holder', w, 'until', tostring(now + hold), 'handoff', handoff)
  redis.call('PEXPIRE', KEYS[1], hold)
  redis.call('HDEL', KEYS[2], w)
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', '1000', '*', 'worker', w, 'function', entry.fn,
    'margin_ms', tostring(margin), 'active', tostring(active), 'waiters', tostring(count),
    'runner_up_ms', second == nil and '' or tostring(second))
  if handoff == '1' then
    local wake = KEYS[5] .. w
    redis.call('LPUSH', wake, '1')
    redis.call('LTRIM', wake, 0, 0)
    redis.call('PEXPIRE', wake, entry.lease)
  end
end

-- the slot is free: hand it to the best waiter, if any; returns that waiter
local function hand_on(ttl)
  local active = count_active(ttl, nil)
  local best, margin, entry, second, count = best_waiter(active)
  if best ~= nil then
    grant(best, entry, margin, active, second, count, '1')
  end
  return best
end

local function release(ttl)
  if redis.call('HGET', KEYS[1], 'holder') == worker then
    redis.call('DEL', KEYS[1])
    hand_on(ttl)
    return 1
  end
  return 0
end

if op == 'release' then
  return release(tonumber(ARGV[3]))
end
if op == 'idle' then
  redis.call('ZREM', KEYS[3], worker)
  redis.call('HDEL', KEYS[2], worker)
  release(tonumber(ARGV[3]))
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

local slot = redis.call('HMGET', KEYS[1], 'holder', 'until', 'handoff')
local holder, lease_end, handoff = slot[1], tonumber(slot[2]), slot[3]
if holder and (lease_end == nil or lease_end <= now) then
  redis.call('DEL', KEYS[1]) -- its holder died or hung: the lease ended
  holder = false
end
if holder == worker and handoff == '1' then -- handed to this worker while it waited: take it
  redis.call('HSET', KEYS[1], 'handoff', '0', 'until', tostring(now + lease))
  redis.call('PEXPIRE', KEYS[1], lease)
  redis.call('HDEL', KEYS[2], worker)
  return {1, tostring(own), active, 0}
end
redis.call('HSET', KEYS[2], worker, ARGV[4] .. '|' .. ARGV[5] .. '|' .. tostring(now + waiter_ttl) .. '|'
  .. tostring(lease) .. '|' .. fn)
redis.call('PEXPIRE', KEYS[2], waiter_ttl * 10)
if holder == worker then -- asking again after its own step: compete afresh (a long prefill does not keep it)
  redis.call('DEL', KEYS[1])
  holder = false
end
if holder then
  return {0, tostring(own), active, holder, math.max(1, lease_end - now)}
end
local best, margin, entry, second, count = best_waiter(active)
if best == worker then
  grant(worker, entry, margin, active, second, count, '0')
  return {1, tostring(own), active, count}
end
grant(best, entry, margin, active, second, count, '1')
return {0, tostring(own), active, best, 1}
