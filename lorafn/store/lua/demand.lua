-- Record cold-start demand for a function, at most once per guard period.
-- KEYS: 1 demand guard (string), 2 demand stream, 3 stats hash
-- ARGV: 1 function, 2 guard period (ms), 3 reason, 4 demand stream max length (approximate)
-- Returns the demand entry id, or false when a fresh record already exists.
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[2]) then
  return false
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HINCRBY', KEYS[3], 'demand_records', 1)
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*',
  'function', ARGV[1], 'reason', ARGV[3], 'at', tostring(now))
