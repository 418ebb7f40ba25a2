-- Count the workers whose heartbeat is younger than a ttl, on the server's clock.
-- KEYS: 1 function-workers zset;  ARGV: 1 ttl (ms)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], now - tonumber(ARGV[1]), '+inf')
