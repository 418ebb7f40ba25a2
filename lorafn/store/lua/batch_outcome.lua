-- Record the outcome of one batch request exactly once (docs/batch.md#exactly-once).
-- KEYS: 1 results hash, 2 errors hash, 3 inflight hash, 4 batch hash
-- ARGV: 1 custom_id, 2 the output/error line, 3 'completed' (into results), 'failed' or 'cancelled'
--       (into errors); the batch hash's counter of that name goes up by one
-- A custom_id already answered (in either hash) is not written again: a request that a re-claim or a
-- retry ran twice yields one line. Returns 1 when this call recorded it, 0 when it was there already.
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  return 0
end
local target = KEYS[2]
if ARGV[3] == 'completed' then target = KEYS[1] end
redis.call('HSET', target, ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[4], ARGV[3], 1)
return 1
