-- swap: replace KEYS[1] by ARGV[2] (PX ARGV[3]), only if it still holds
-- exactly ARGV[1]. This is how `begin` replaces a record it has read and
-- found expired by the proxies' clock, or a claim whose holder died.
-- Replies 1 when replaced, 0 when the key changed since it was read.
local v = redis.pcall('GET', KEYS[1])
if v ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
