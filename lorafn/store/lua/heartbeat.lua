-- Register or refresh a worker: its description hash (expiring) and its heartbeat scores.
-- KEYS: 1 worker hash, 2 all-workers zset, 3 (optional) function-workers zset
-- ARGV: 1 worker id, 2 ttl (ms), 3.. field, value pairs for the worker hash
-- Returns the server time (ms) written as the heartbeat.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'heartbeat', tostring(now))
for i = 3, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', KEYS[1], ttl)
for k = 2, #KEYS do
  redis.call('ZADD', KEYS[k], now, ARGV[1])
  -- forget workers silent for ten heartbeat periods: the sets stay small
  redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', now - 10 * ttl)
end
return now
