-- Depth of each function's request stream (control.queue_depths): for KEYS[i], its length, the entries
-- delivered to a worker and not acked (pending in group ARGV[1]), and how long (ms, by Redis's clock) the
-- oldest entry not yet delivered has waited: entry ids are admission times (XADD *), and the undelivered
-- entries are those after the group's last-delivered-id (all of them where no group exists yet).
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i, key in ipairs(KEYS) do
  local length = redis.call('XLEN', key)
  local pending = 0
  local wait_ms = 0
  if length > 0 then
    local last = '0-0'
    local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', key)
    if ok then
      for _, g in ipairs(groups) do
        local name, delivered, count = nil, nil, 0
        for j = 1, #g, 2 do
          if g[j] == 'name' then name = g[j + 1]
          elseif g[j] == 'last-delivered-id' then delivered = g[j + 1]
          elseif g[j] == 'pending' then count = g[j + 1] end
        end
        if name == ARGV[1] then
          last = delivered or '0-0'
          pending = count
        end
      end
    end
    if length > pending then
      local first = redis.call('XRANGE', key, '(' .. last, '+', 'COUNT', 1)
      if first[1] then
        local ms = tonumber(string.match(first[1][1], '^(%d+)'))
        if ms then wait_ms = math.max(0, now_ms - ms) end
      end
    end
  end
  out[3 * i - 2] = length
  out[3 * i - 1] = pending
  out[3 * i] = wait_ms
end
return out
