-- remove: delete KEYS[1] whatever it holds (operator reconciliation, corrupt
-- values included). Replies 1 when there was a live record, 0 when the key
-- was absent or already expired by the proxies' clock (ARGV[1], Unix ms).
local key = KEYS[1]
local exp = redis.pcall('HGET', key, 'exp')
if redis.call('DEL', key) == 0 then
  return 0
end
local exp_ms = type(exp) == 'string' and tonumber(exp)
if exp_ms and exp_ms <= tonumber(ARGV[1]) then
  return 0
end
return 1
