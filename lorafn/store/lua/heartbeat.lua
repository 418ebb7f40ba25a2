-- Register or refresh a worker: its description hash (expiring) and its heartbeat scores.
-- KEYS: 1 worker hash, 2 all-workers zset, 3 (optional) function-workers zset
-- ARGV: 1 worker id, 2 ttl (ms), 3 '1': register only while the function has no other live worker (a
--       pre-loaded standby taking its function's first request; needs KEYS[3]), '0' otherwise,
--       4.. field, value pairs for the worker hash
-- Returns the server time (ms) written as the heartbeat, or 0 when ARGV[3] is '1' and the function has a
-- live worker already (nothing is written then).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
if ARGV[3] == '1' then
  if #KEYS < 3 then
    return redis.error_reply('an only-if-alone heartbeat needs the function-workers key')
  end
  local others = redis.call('ZCOUNT', KEYS[3], now - ttl, '+inf')
  if redis.call('ZSCORE', KEYS[3], ARGV[1]) then
    others = others - 1  -- its own earlier registration does not count (a repeated attempt)
  end
  if others > 0 then
    return 0
  end
end
redis.call('HSET', KEYS[1], 'heartbeat', tostring(now))
for i = 4, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', KEYS[1], ttl)
for k = 2, #KEYS do
  redis.call('ZADD', KEYS[k], now, ARGV[1])
  -- forget workers silent for ten heartbeat periods: the sets stay small
  redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', now - 10 * ttl)
end
return now
