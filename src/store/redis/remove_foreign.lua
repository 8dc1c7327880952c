-- remove_foreign: delete KEYS[1] only if it holds something other than a
-- string (a hash of an earlier build, or anything else): no record of this
-- store's, so no claim. A string there now is a record written since the
-- key was read (a claim): it is left alone, as is a key that is gone.
-- Replies 1 when deleted, 0 otherwise.
local t = redis.call('TYPE', KEYS[1]).ok
if t == 'string' or t == 'none' then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
