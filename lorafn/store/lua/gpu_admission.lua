-- The prefill token budget of one GPU: cross-function admission by smallest deadline margin (DESIGN §7).
-- A worker asks for the tokens its next step prefills; prefills run at once while their tokens fit in
-- the budget (one larger than the whole budget runs alone once nothing is held). Waiters are served in
-- the order of their margin deadline - now - M * t (M = active batches on the GPU, the asker counted as
-- one if it has none yet; ties to the smaller worker id); a waiter whose margin is smaller than the
-- expected wait for the soonest running prefill to end (granted_at + t) goes at once, over the budget
-- (urgent); the first that neither fits nor is urgent stops the line. lorafn.runtime.slo.admit is the
-- reference.
-- Freed tokens are handed straight to the best waiters (holder entry flagged `handoff`, a token pushed
-- on the waiter's wake list): a waiter blocked on that list starts at once, without polling.
-- KEYS: 1 holders hash (worker -> until|handoff|tokens|granted_at|t), 2 waiting hash (worker ->
--       deadline|t|expires|lease|tokens|since|fn), 3 active zset (worker -> last active ms),
--       4 admissions stream (capped; `grant` entries: worker, function, margin_ms, active, waiters,
--       runner_up_ms = the next margin in line, tokens, used = budget held after it, waited_ms;
--       `release` entries: worker, held_ms, prefilled = sequences its step prefilled, late_ms = from the
--       step's end to the release), 5 wake-list key prefix (+ worker id: the list a waiter blocks on)
-- ARGV: 1 op, 2 worker id, then per op:
--   ask:     3 function, 4 deadline (unix ms; `none`: only offline batch requests to prefill, no deadline:
--            margin +inf, so it is never urgent and goes behind every waiter with a deadline), 5 t (ms), 6 lease (ms), 7 waiter ttl (ms), 8 active ttl (ms),
--            9 budget (tokens), 10 tokens
--            -> {1, margin, M, waiters, tokens}  granted (its share is held until released or the lease
--            ends); `tokens`: what the share holds, the most its step may prefill. A share handed on while
--            it waited holds the tokens of that earlier ask (what the budget counted), or fewer if it now
--            asks for fewer: a step never prefills more than the budget granted.
--            A worker that kept its share after a step (it has more to prefill) gives it up here and
--            competes afresh in the same call: no round trip in which a looser waiter could take it.
--            -> {0, margin, M, a holder or the waiter first in line, retry_ms}
--   release: 3 active ttl (ms), 4 budget, 5 prefilled (-1: unknown), 6 step end (unix ms, 0: unknown)
--            -> 1 when the asker held a share (now handed on or free), else 0
--   active:  3 active ttl (ms) -> M (the asker marked active)
--   idle:    3 active ttl (ms), 4 budget -> 1; the asker leaves the active set and the waiters, and hands
--            on its share
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

-- live holders (those whose lease ended are dropped): tokens held, the asker's entry, another holder,
-- the soonest lease end, and how long until the soonest running prefill of another worker is expected
-- to end
local function holders()
  local all = redis.call('HGETALL', KEYS[1])
  local used, mine, any, soonest, wait = 0, nil, nil, nil, nil
  for i = 1, #all, 2 do
    local w = all[i]
    local u, flag, tok, at, tt = string.match(all[i + 1], '^([^|]+)|([^|]+)|([^|]+)|([^|]+)|(.*)$')
    u = tonumber(u)
    if u == nil or u <= now then
      redis.call('HDEL', KEYS[1], w) -- its holder died or hung, or a hand-off was not taken: lease over
    else
      used = used + tonumber(tok)
      if w == worker then
        mine = {flag = flag, tokens = tonumber(tok), at = tonumber(at), t = tt}
      else
        any = w
      end
      if soonest == nil or u < soonest then soonest = u end
      local left = math.max(0, tonumber(at) + (tonumber(tt) or 0) - now)
      if w ~= worker and (wait == nil or left < wait) then wait = left end
    end
  end
  return used, mine, any, soonest, wait or 0
end

-- the live waiters by margin (forgetting those that stopped asking)
local function deadline_of(s)
  if s == 'none' then return math.huge end
  return tonumber(s)
end

local function waiters_in_order(active)
  local out = {}
  local all = redis.call('HGETALL', KEYS[2])
  for i = 1, #all, 2 do
    local w, entry = all[i], all[i + 1]
    local dl, tt, exp, lease, tok, since, fn =
      string.match(entry, '^([^|]+)|([^|]+)|([^|]+)|([^|]+)|([^|]+)|([^|]+)|(.*)$')
    exp = tonumber(exp)
    if exp == nil or exp <= now then
      redis.call('HDEL', KEYS[2], w)
    else
      out[#out + 1] = {worker = w, margin = deadline_of(dl) - now - active * tonumber(tt), expires = exp, t = tt,
        lease = tonumber(lease), tokens = tonumber(tok), since = tonumber(since), fn = fn}
    end
  end
  table.sort(out, function(a, b)
    if a.margin ~= b.margin then return a.margin < b.margin end
    return a.worker < b.worker
  end)
  return out
end

-- grant the waiters in line while they fit; returns true when `asker` was granted (its hold: its lease;
-- another waiter's: until its waiter entry would expire, the token on its wake list tells it)
local function admit(active, used, budget, asker, wait)
  local line = waiters_in_order(active)
  local granted_asker = false
  for i, e in ipairs(line) do
    if used > 0 and used + e.tokens > budget and not (e.margin < wait) then break end
    used = used + e.tokens
    local handoff = e.worker == asker and '0' or '1'
    local hold = handoff == '1' and math.max(1, e.expires - now) or e.lease
    redis.call('HSET', KEYS[1], e.worker, tostring(now + hold) .. '|' .. handoff .. '|' .. tostring(e.tokens)
      .. '|' .. tostring(now) .. '|' .. e.t)
    redis.call('PEXPIRE', KEYS[1], 60000)
    redis.call('HDEL', KEYS[2], e.worker)
    local second = line[i + 1]
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', '5000', '*', 'event', 'grant', 'worker', e.worker,
      'function', e.fn, 'margin_ms', tostring(e.margin), 'active', tostring(active),
      'waiters', tostring(#line - i + 1), 'runner_up_ms', second == nil and '' or tostring(second.margin),
      'tokens', tostring(e.tokens), 'used', tostring(used), 'waited_ms', tostring(now - e.since))
    if handoff == '1' then
      local wake = KEYS[5] .. e.worker
      redis.call('LPUSH', wake, '1')
      redis.call('LTRIM', wake, 0, 0)
      redis.call('PEXPIRE', wake, hold)
    else
      granted_asker = true
    end
  end
  return granted_asker, line
end

local function release(ttl, budget, prefilled, step_end)
  local entry = redis.call('HGET', KEYS[1], worker)
  if not entry then return 0 end
  redis.call('HDEL', KEYS[1], worker)
  local at = tonumber(string.match(entry, '^[^|]+|[^|]+|[^|]+|([^|]+)|')) or now
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', '5000', '*', 'event', 'release', 'worker', worker,
    'held_ms', tostring(now - at), 'prefilled', tostring(prefilled),
    'late_ms', step_end > 0 and tostring(now - step_end) or '')
  local used, _, _, _, wait = holders()
  admit(count_active(ttl, nil), used, budget, nil, wait)
  return 1
end

if op == 'release' then
  return release(tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]))
end
if op == 'idle' then
  redis.call('ZREM', KEYS[3], worker)
  redis.call('HDEL', KEYS[2], worker)
  release(tonumber(ARGV[3]), tonumber(ARGV[4]), -1, 0)
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
local deadline = deadline_of(ARGV[4])
local t_ms = tonumber(ARGV[5])
local lease = tonumber(ARGV[6])
local waiter_ttl = tonumber(ARGV[7])
local active_ttl = tonumber(ARGV[8])
local budget = tonumber(ARGV[9])
local tokens = tonumber(ARGV[10])
local active = count_active(active_ttl, worker)
local own = deadline - now - active * t_ms

local used, mine, any, soonest, wait = holders()
if mine ~= nil and mine.flag == '1' then -- handed to this worker while it waited: take it
  -- the budget granted the tokens of the ask it waited with; more arrived since wait for the next grant
  local granted = math.min(mine.tokens, tokens)
  redis.call('HSET', KEYS[1], worker, tostring(now + lease) .. '|0|' .. tostring(granted) .. '|'
    .. tostring(mine.at) .. '|' .. ARGV[5])
  redis.call('HDEL', KEYS[2], worker)
  return {1, tostring(own), active, 0, granted}
end
if mine ~= nil then -- kept from its last step (more to prefill): give it up and compete afresh, at once
  redis.call('HDEL', KEYS[1], worker)
  used = used - mine.tokens
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', '5000', '*', 'event', 'release', 'worker', worker,
    'held_ms', tostring(now - mine.at), 'prefilled', '-1', 'late_ms', '')
end
-- the waiter entry keeps the time it first asked (`since`: the grant records how long it waited)
local since = now
local prev = redis.call('HGET', KEYS[2], worker)
if prev then
  since = tonumber(string.match(prev, '^[^|]+|[^|]+|[^|]+|[^|]+|[^|]+|([^|]+)|')) or now
end
redis.call('HSET', KEYS[2], worker, ARGV[4] .. '|' .. ARGV[5] .. '|' .. tostring(now + waiter_ttl) .. '|'
  .. tostring(lease) .. '|' .. tostring(tokens) .. '|' .. tostring(since) .. '|' .. fn)
redis.call('PEXPIRE', KEYS[2], waiter_ttl * 10)
local granted, line = admit(active, used, budget, worker, wait)
if granted then
  return {1, tostring(own), active, #line, tokens}
end
local other = any -- a holder, else the waiter first in line
for _, e in ipairs(line) do
  if other == nil and e.worker ~= worker then other = e.worker end
end
local retry = soonest and math.max(1, soonest - now) or 1
return {0, tostring(own), active, other or '', retry}
