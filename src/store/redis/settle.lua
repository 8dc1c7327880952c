-- settle: complete or release the pending claim KEYS[1], for the holder of
-- its fencing token only.
--
-- KEYS[1]  the record key
-- ARGV[1]  now, Unix ms (the proxy's wall clock)
-- ARGV[2]  the caller's fencing token (16 bytes)
-- ARGV[3]  "complete" or "release"
-- complete only:
-- ARGV[4]  fingerprint of the completed record (32 bytes)
-- ARGV[5]  expires_at of the completed record (Unix ms)
-- ARGV[6]  the completed record, Record::encode()
-- ARGV[7]  PEXPIRE (ms from now)
--
-- Replies: {"ok"}, {"fenced"}, {"corrupt", why}.
local key = KEYS[1]
local h = redis.pcall('HMGET', key, 'st', 'tok', 'exp')
if h.err then
  return {'corrupt', h.err}
end
local st, tok, exp = h[1], h[2], h[3]
if st and st ~= 'p' and st ~= 'c' and st ~= 'a' then
  return {'corrupt', 'unknown record state'}
end
if st and not tonumber(exp) then
  return {'corrupt', 'record hash lacks a valid exp field'}
end
-- Absent, expired (by the proxies' clock), settled, or claimed by another
-- holder: the caller does not own the key and changes nothing.
if st ~= 'p' or tonumber(exp) <= tonumber(ARGV[1]) or tok ~= ARGV[2] then
  return {'fenced'}
end
redis.call('DEL', key)
if ARGV[3] == 'complete' then
  redis.call('HSET', key, 'st', 'c', 'fp', ARGV[4], 'exp', ARGV[5], 'rec', ARGV[6])
  redis.call('PEXPIRE', key, ARGV[7])
end
return {'ok'}
