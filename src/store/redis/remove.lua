-- remove: delete KEYS[1] only if it still holds exactly ARGV[1], the value
-- the proxy read (and, for a guarded DELETE, found to be no running
-- claim). This is how the admin API's DELETE, forced or not, keeps a
-- request that claimed the key after that read from losing its claim,
-- even when the cluster client sends the script again. Replies 1 when
-- deleted, 0 when the key changed since it was read.
local v = redis.pcall('GET', KEYS[1])
if v ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
