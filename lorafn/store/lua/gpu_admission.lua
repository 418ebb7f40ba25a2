-- The prefill slot of one GPU: cross-function admission by smallest deadline margin (DESIGN §7).
-- Margin of a waiter: deadline - now - M * t, M = active batches on the GPU (the asker counted as one
-- if it has none yet); ties go to the smaller worker id. lorafn.runtime.slo.pick is the reference.
-- KEYS: 1 slot hash (holder, until), 2 waiting hash (worker -> deadline|t|expires|function),
--       3 active zset (worker -> last active ms), 4 admissions stream (grants, capped: worker, function,
--       margin_ms, active, waiters, runner_up_ms = the next smallest margin among the waiters)
-- ARGV: 1 op, 2 worker id, then per op:
--   ask:     3 function, 4 deadline (unix ms), 5 t (ms), 6 lease (ms), 7 waiter ttl (ms), 8 active ttl (ms)
--            -> {1, margin, M, waiters}  granted (the slot is the asker's until released or the lease ends)
--            -> {0, margin, M, holder or best waiter, retry_ms}
--   release: -> 1 when the asker held the slot (now free), else 0
--   active:  3 active ttl (ms) -> M (the asker marked active)
--   idle:    -> 1; the asker leaves the active set and the waiters, and frees the slot if it held it
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op = ARGV[1]
local worker = ARGV[2]

local function release()
  if redis.call('HGET', KEYS[1], 'holder') == worker then
    redis.call('DEL', KEYS[1])
    return 1
  end
  return 0
end

if op == 'release' then
  return release()
end
if op == 'idle' then
  redis.call('ZREM', KEYS[3], worker)
  redis.call('HDEL', KEYS[2], worker)
  release()
  return 1
end
if op == 'active' then
  local ttl = tonumber(ARGV[3])
  redis.call('ZADD', KEYS[3], now, worker)
  redis.call('PEXPIRE', KEYS[3], ttl * 10)
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - ttl)
  return redis.call('ZCARD', KEYS[3])
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

-- asking again while holding the slot: compete afresh (a long prefill does not keep the GPU)
release()
local slot = redis.call('HMGET', KEYS[1], 'holder', 'until')
local holder, lease_end = slot[1], tonumber(slot[2])
if holder and (lease_end == nil or lease_end <= now) then
  redis.call('DEL', KEYS[1]) -- its holder died or hung: the lease ended
  holder = false
end
redis.call('HSET', KEYS[2], worker, ARGV[4] .. '|' .. ARGV[5] .. '|' .. tostring(now + waiter_ttl) .. '|' .. fn)
redis.call('PEXPIRE', KEYS[2], waiter_ttl * 10)

redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - active_ttl)
local active = redis.call('ZCARD', KEYS[3])
if not redis.call('ZSCORE', KEYS[3], worker) then
  active = active + 1
end
local own = deadline - now - active * t_ms
if holder then
  return {0, tostring(own), active, holder, math.max(1, lease_end - now)}
end

local best, best_margin, second, count = nil, nil, nil, 0
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local w = all[i]
  local dl, tt, exp = string.match(all[i + 1], '^([^|]+)|([^|]+)|([^|]+)|')
  exp = tonumber(exp)
  if exp == nil or exp <= now then
    redis.call('HDEL', KEYS[2], w) -- a waiter that stopped asking
  else
    count = count + 1
    local m = tonumber(dl) - now - active * tonumber(tt)
    if best == nil or m < best_margin or (m == best_margin and w < best) then
      if best ~= nil then second = best_margin end
      best, best_margin = w, m
    elseif second == nil or m < second then
      second = m
    end
  end
end

if best == worker then
  redis.call('HSET', KEYS[1], 'holder', worker, 'until', tostring(now + lease))
  redis.call('PEXPIRE', KEYS[1], lease)
  redis.call('HDEL', KEYS[2], worker)
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', '1000', '*', 'worker', worker, 'function', fn,
    'margin_ms', tostring(own), 'active', tostring(active), 'waiters', tostring(count),
    'runner_up_ms', second == nil and '' or tostring(second))
  return {1, tostring(own), active, count}
end
return {0, tostring(own), active, best, 1}
