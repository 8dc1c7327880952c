-- settle: complete or release the pending claim KEYS[1], for the holder of
-- its fencing token only.
--
-- A record is a string: a 25-byte header, then the record's bytes (see
-- "Layout" in mod.rs). The script reads the header only: byte 1 the state,
-- bytes 2-17 the claim's fencing token, bytes 18-25 expires_at.
--
-- KEYS[1]  the record key
-- ARGV[1]  now, Unix ms (the proxy's wall clock)
-- ARGV[2]  "p" and the caller's fencing token: the first 17 bytes of its claim
-- ARGV[3]  the completed record (header and bytes), or "" to release
-- ARGV[4]  PX of the completed record (ms from now)
--
-- Replies: 1 (settled), 0 (fenced: the caller does not hold the key), or
-- {"corrupt", why}. Integers, not status words: a table reply costs Redis
-- more to convert, on every completion.
local key = KEYS[1]
local v = redis.pcall('GET', key)
if type(v) == 'table' then
  return {'corrupt', v.err}
end
if not v then
  return 0
end
local st = string.sub(v, 1, 1)
if #v < 26 or (st ~= 'p' and st ~= 'c') then
  return {'corrupt', 'the value is not a record'}
end
-- This very completion, written before: a completion sent again (its
-- replica acknowledgement fell short, or its reply was lost) succeeds
-- without writing, so the caller can wait for the replicas once more.
if ARGV[3] ~= '' and v == ARGV[3] then
  return 1
end
-- Settled, or claimed by another holder: the caller does not own the key
-- and changes nothing.
if string.sub(v, 1, 17) ~= ARGV[2] then
  return 0
end
-- Expired by the proxies' clock, whether or not Redis reclaimed it yet.
-- (Milliseconds fit a Lua number's 53 bits exactly.)
local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(v, 18, 25)
local exp = ((((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6) * 256 + b7) * 256 + b8
if exp <= tonumber(ARGV[1]) then
  return 0
end
if ARGV[3] == '' then
  redis.call('DEL', key)
else
  redis.call('SET', key, ARGV[3], 'PX', ARGV[4])
end
return 1
