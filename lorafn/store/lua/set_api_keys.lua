-- Replace the API keys (hashes) of one function; a key may open only one function.
-- KEYS: 1 api-key index hash (hash -> function), 2 the function's key set
-- ARGV: 1 function, 2.. key hashes
-- Errors (and changes nothing) when a hash already opens another function.
for i = 2, #ARGV do
  local owner = redis.call('HGET', KEYS[1], ARGV[i])
  if owner and owner ~= ARGV[1] then
    return redis.error_reply('API_KEY_TAKEN an API key may open only one function; this one opens another')
  end
end
local old = redis.call('SMEMBERS', KEYS[2])
for _, h in ipairs(old) do
  if redis.call('HGET', KEYS[1], h) == ARGV[1] then
    redis.call('HDEL', KEYS[1], h)
  end
end
redis.call('DEL', KEYS[2])
for i = 2, #ARGV do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[1])
  redis.call('SADD', KEYS[2], ARGV[i])
end
return #ARGV - 1
