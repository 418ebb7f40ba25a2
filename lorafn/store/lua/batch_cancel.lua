-- Ask a batch to stop (POST /v1/batches/{id}/cancel): an unfinished batch becomes `cancelling`; the
-- batch runner then stops submitting, cancels what runs and writes the files (`cancelled`).
-- KEYS: 1 batch hash;  ARGV: 1 now (unix s)
-- Returns the status after the call ('' when the batch does not exist).
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
  return 'cancelling'
end
return status
