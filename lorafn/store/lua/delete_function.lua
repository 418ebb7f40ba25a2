-- Remove a function's registration and the API keys that open it (its streams expire or stay for audit).
-- KEYS: 1 functions set, 2 function hash, 3 the function's key set, 4 api-key index hash
-- ARGV: 1 function
-- Returns 1 when the function existed.
local hashes = redis.call('SMEMBERS', KEYS[3])
for _, h in ipairs(hashes) do
  if redis.call('HGET', KEYS[4], h) == ARGV[1] then
    redis.call('HDEL', KEYS[4], h)
  end
end
redis.call('DEL', KEYS[2], KEYS[3])
return redis.call('SREM', KEYS[1], ARGV[1])
