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
-- Decode gating (lorafn.runtime.slo.is_urgent is the reference): a grant whose margin is below the
-- asker's urgent threshold (and whose deadline has not passed) is *urgent*: it is listed in the urgent
-- hash until its share is released (or its lease ends). Other workers read that hash on the round trip
-- they make after every step (only while others are active on the GPU) and, seeing another's urgent
-- grant, `gate`: they join the paused set and block on their gate-wake list, at most their own bound
-- (their TPOT slack); the end of the last live urgent grant pushes a token on every paused worker's list.
-- KEYS: 1 holders hash (worker -> until|handoff|tokens|granted_at|t|urgent), 2 waiting hash (worker ->
--       deadline|t|expires|lease|tokens|since|urgent_ms|fn), 3 active zset (worker -> last active ms),
--       4 admissions stream (capped; `grant` entries: worker, function, margin_ms, active, waiters,
--       runner_up_ms = the next margin in line, tokens, used = budget held after it, waited_ms;
--       `release` entries: worker, held_ms, prefilled = sequences its step prefilled, late_ms = from the
--       step's end to the release), 5 wake-list key prefix (+ worker id: the list a waiter blocks on),
--       6 urgent hash (worker -> lease end ms of its urgent grant), 7 paused set (workers blocked in a
--       gate), 8 gate-wake list key prefix (+ worker id), 9 gating counters hash (`urgent_grants` here;
--       the workers add `gated_steps`, `gated_ms`, `timeouts`)
-- ARGV: 1 op, 2 worker id, then per op:
--   ask:     3 function, 4 deadline (unix ms; `none`: only offline batch requests to prefill, no deadline:
--            margin +inf, so it is never urgent and goes behind every waiter with a deadline), 5 t (ms), 6 lease (ms), 7 waiter ttl (ms), 8 active ttl (ms),
--            9 budget (tokens), 10 tokens, 11 urgent threshold (ms; 0 or absent: never urgent)
--            -> {1, margin, M, waiters, tokens, urgent 0/1}  granted (its share is held until released or the lease
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
--   urgent_end: -> 1; the asker's urgent grant ends (its step ran; it keeps its share for the next ask)
--   gate:    -> the live urgent grants of other workers; with some, the asker joins the paused set (its
--            gate-wake list emptied first), with none a `0` token lets its BLPOP return at once
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
    local u, flag, tok, at, tt, urg =
      string.match(all[i + 1], '^([^|]+)|([^|]+)|([^|]+)|([^|]+)|([^|]+)|(.*)$')
    u = tonumber(u)
    if u == nil or u <= now then
      redis.call('HDEL', KEYS[1], w) -- its holder died or hung, or a hand-off was not taken: lease over
      redis.call('HDEL', KEYS[6], w)
    else
      used = used + tonumber(tok)
      if w == worker then
        mine = {flag = flag, tokens = tonumber(tok), at = tonumber(at), t = tt, urgent = urg}
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
    local dl, tt, exp, lease, tok, since, urg, fn =
      string.match(entry, '^([^|]+)|([^|]+)|([^|]+)|([^|]+)|([^|]+)|([^|]+)|([^|]+)|(.*)$')
    exp = tonumber(exp)
    if exp == nil or exp <= now then
      redis.call('HDEL', KEYS[2], w)
    else
      out[#out + 1] = {worker = w, margin = deadline_of(dl) - now - active * tonumber(tt), expires = exp, t = tt,
        lease = tonumber(lease), tokens = tonumber(tok), since = tonumber(since), fn = fn,
        urgent_ms = tonumber(urg) or 0, left = deadline_of(dl) - now}
    end
  end
  table.sort(out, function(a, b)
    if a.margin ~= b.margin then return a.margin < b.margin end
    return a.worker < b.worker
  end)
  return out
end

-- the live urgent grants of workers other than `except` (entries whose lease ended are dropped)
local function urgent_live(except)
  local all = redis.call('HGETALL', KEYS[6])
  local live = 0
  for i = 1, #all, 2 do
    local u = tonumber(all[i + 1])
    if u == nil or u <= now then
      redis.call('HDEL', KEYS[6], all[i])
    elseif all[i] ~= except then
      live = live + 1
    end
  end
  return live
end

-- once no urgent grant is live, every paused worker goes on (a token on its gate-wake list)
local function wake_if_calm()
  if urgent_live(nil) > 0 then return end
  local paused = redis.call('SMEMBERS', KEYS[7])
  for _, m in ipairs(paused) do
    local k = KEYS[8] .. m
    redis.call('LPUSH', k, '1')
    redis.call('LTRIM', k, 0, 0)
    redis.call('PEXPIRE', k, 5000)
  end
  if #paused > 0 then redis.call('DEL', KEYS[7]) end
end

-- grant the waiters in line while they fit; returns true when `asker` was granted (its hold: its lease;
-- another waiter's: until its waiter entry would expire, the token on its wake list tells it)
local function admit(active, used, budget, asker, wait)
  local line = waiters_in_order(active)
  local granted_asker = false -- or 1 (granted), 2 (granted, urgent)
  for i, e in ipairs(line) do
    if used > 0 and used + e.tokens > budget and not (e.margin < wait) then break end
    used = used + e.tokens
    local handoff = e.worker == asker and '0' or '1'
    local hold = handoff == '1' and math.max(1, e.expires - now) or e.lease
    -- urgent (slo.is_urgent): a small margin, the deadline not passed yet
    local urgent = e.urgent_ms > 0 and e.left > 0 and e.margin < e.urgent_ms
    redis.call('HSET', KEYS[1], e.worker, tostring(now + hold) .. '|' .. handoff .. '|' .. tostring(e.tokens)
      .. '|' .. tostring(now) .. '|' .. e.t .. '|' .. (urgent and '1' or '0'))
    redis.call('PEXPIRE', KEYS[1], 60000)
    if urgent then
      redis.call('HSET', KEYS[6], e.worker, tostring(now + hold))
      redis.call('PEXPIRE', KEYS[6], 60000)
      redis.call('HINCRBY', KEYS[9], 'urgent_grants', 1)
    end
    redis.call('HDEL', KEYS[2], e.worker)
    local second = line[i + 1]
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', '5000', '*', 'event', 'grant', 'worker', e.worker,
      'function', e.fn, 'margin_ms', tostring(e.margin), 'active', tostring(active),
      'waiters', tostring(#line - i + 1), 'runner_up_ms', second == nil and '' or tostring(second.margin),
      'tokens', tostring(e.tokens), 'used', tostring(used), 'waited_ms', tostring(now - e.since),
      'urgent', urgent and '1' or '0')
    if handoff == '1' then
      local wake = KEYS[5] .. e.worker
      redis.call('LPUSH', wake, '1')
      redis.call('LTRIM', wake, 0, 0)
      redis.call('PEXPIRE', wake, hold)
    else
      granted_asker = urgent and 2 or 1
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
  redis.call('HDEL', KEYS[6], worker)
  admit(count_active(ttl, nil), used, budget, nil, wait)
  wake_if_calm()
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
if op == 'urgent_end' then
  redis.call('HDEL', KEYS[6], worker)
  wake_if_calm()
  return 1
end
if op == 'gate' then
  local k = KEYS[8] .. worker
  redis.call('DEL', k) -- a token left by a wake that came after its last wait had timed out
  local live = urgent_live(worker)
  if live == 0 then
    redis.call('LPUSH', k, '0')
    redis.call('PEXPIRE', k, 5000)
    return 0
  end
  redis.call('SADD', KEYS[7], worker)
  redis.call('PEXPIRE', KEYS[7], 60000)
  return live
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
local urgent_ms = tonumber(ARGV[11] or '0') or 0
local active = count_active(active_ttl, worker)
local own = deadline - now - active * t_ms

local used, mine, any, soonest, wait = holders()
if mine ~= nil and mine.flag == '1' then -- handed to this worker while it waited: take it
  -- the budget granted the tokens of the ask it waited with; more arrived since wait for the next grant
  local granted = math.min(mine.tokens, tokens)
  redis.call('HSET', KEYS[1], worker, tostring(now + lease) .. '|0|' .. tostring(granted) .. '|'
    .. tostring(mine.at) .. '|' .. ARGV[5] .. '|' .. mine.urgent)
  redis.call('HDEL', KEYS[2], worker)
  if mine.urgent == '1' then -- its urgent mark lasts as long as the share now does
    redis.call('HSET', KEYS[6], worker, tostring(now + lease))
  end
  return {1, tostring(own), active, 0, granted, tonumber(mine.urgent) or 0}
end
if mine ~= nil then -- kept from its last step (more to prefill): give it up and compete afresh, at once
  redis.call('HDEL', KEYS[1], worker)
  redis.call('HDEL', KEYS[6], worker) -- re-marked below if this ask is granted urgent again
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
  .. tostring(lease) .. '|' .. tostring(tokens) .. '|' .. tostring(since) .. '|' .. tostring(urgent_ms)
  .. '|' .. fn)
redis.call('PEXPIRE', KEYS[2], waiter_ttl * 10)
local granted, line = admit(active, used, budget, worker, wait)
if mine ~= nil and mine.urgent == '1' then wake_if_calm() end -- its kept urgent share ended here
if granted then
  return {1, tostring(own), active, #line, tokens, granted == 2 and 1 or 0}
end
local other = any -- a holder, else the waiter first in line
for _, e in ipairs(line) do
  if other == nil and e.worker ~= worker then other = e.worker end
end
local retry = soonest and math.max(1, soonest - now) or 1
return {0, tostring(own), active, other or '', retry}
