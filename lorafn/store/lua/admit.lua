-- Admit one invocation atomically: per-function token bucket, queue-depth cap, statistics, enqueue.
-- KEYS: 1 rate-limit hash, 2 stats hash, 3 arrivals bucket counter, 4 function workers zset,
--       5 request stream
-- ARGV: 1 rate (tokens/s; <= 0: unlimited), 2 burst, 3 arrivals bucket ttl (s),
--       4 heartbeat ttl (ms), 5 request id, 6 body (JSON), 7 deadline (unix ms), 8 max queue (0: none)
-- Returns {0, retry_after_ms} when rate-limited, {2, queue_length} when the queue is full,
--         {1, entry_id, live_workers} when enqueued.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])

if rate > 0 then
  local bucket = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens = tonumber(bucket[1])
  local ts = tonumber(bucket[2])
  if tokens == nil or ts == nil then
    tokens = burst
    ts = now
  end
  tokens = math.min(burst, tokens + math.max(0, now - ts) * rate / 1000)
  if tokens < 1 then
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
    redis.call('HINCRBY', KEYS[2], 'rate_limited', 1)
    return {0, math.ceil((1 - tokens) * 1000 / rate)}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
end

local max_queue = tonumber(ARGV[8])
if max_queue > 0 then
  local depth = redis.call('XLEN', KEYS[5])
  if depth >= max_queue then
    redis.call('HINCRBY', KEYS[2], 'queue_full', 1)
    return {2, depth}
  end
end

redis.call('HINCRBY', KEYS[2], 'requests', 1)
redis.call('INCR', KEYS[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
local live = redis.call('ZCOUNT', KEYS[4], now - tonumber(ARGV[4]), '+inf')
if live == 0 then
  redis.call('HINCRBY', KEYS[2], 'cold_requests', 1)
end
local id = redis.call('XADD', KEYS[5], '*', 'rid', ARGV[5], 'body', ARGV[6], 'deadline', ARGV[7])
return {1, id, live}
