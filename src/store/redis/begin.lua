-- begin: claim KEYS[1], or report what it holds, in one atomic step.
-- The decision mirrors `decide_begin` in src/store/mod.rs exactly; every
-- instant comes from the caller's clock (ARGV[1]), never from Redis's.
--
-- KEYS[1]   the record key
-- ARGV[1]   now, Unix ms (the proxy's wall clock)
-- ARGV[2]   fingerprint of the request (32 bytes)
-- ARGV[3]   on_stale: "store" or "retry"
-- ARGV[4]   fencing token of a new claim (16 bytes)
-- ARGV[5]   lease_expires_at of a new claim (Unix ms)
-- ARGV[6]   expires_at of a new claim (Unix ms)
-- ARGV[7]   the new claim, Record::encode()
-- ARGV[8]   PEXPIRE of a new claim (ms from now)
-- ARGV[9]   expires_at of a stale claim settled as abandoned (Unix ms)
-- ARGV[10]  PEXPIRE of a settled claim (ms from now)
--
-- Replies (arrays): {"acquired", took_over 0|1}, {"completed", rec},
-- {"abandoned", pending rec, completed_at, expires_at} for a claim settled
-- earlier, {"settled", <same fields>} when this call settles it, {"in_flight",
-- lease_expires_at}, {"mismatch", "pending"|"completed"}, {"corrupt", why}.
local key = KEYS[1]
local now = tonumber(ARGV[1])

-- One read for every case: a replay needs rec too.
local h = redis.pcall('HMGET', key, 'st', 'fp', 'exp', 'lease', 'done', 'rec')
if h.err then
  return {'corrupt', h.err}
end
local st, fp, exp, lease, done, rec = h[1], h[2], h[3], h[4], h[5], h[6]

local function claim(took_over, replaces)
  -- An expired or taken-over record may hold fields of another state; a free
  -- key (the common case) has nothing to delete.
  if replaces then
    redis.call('DEL', key)
  end
  redis.call('HSET', key, 'st', 'p', 'fp', ARGV[2], 'tok', ARGV[4],
    'lease', ARGV[5], 'exp', ARGV[6], 'rec', ARGV[7])
  redis.call('PEXPIRE', key, ARGV[8])
  return {'acquired', took_over}
end

if not st and not fp and not exp then
  return claim(0, false)
end
local exp_ms = tonumber(exp)
if not exp_ms or not fp or #fp ~= 32 then
  return {'corrupt', 'record hash lacks a valid fp or exp field'}
end
if exp_ms <= now then
  -- Expired by the proxies' clock: absent, whenever Redis reclaims it.
  return claim(0, true)
end
local state
if st == 'p' then
  state = 'pending'
elseif st == 'c' or st == 'a' then
  state = 'completed'
else
  return {'corrupt', 'unknown record state'}
end
if fp ~= ARGV[2] then
  return {'mismatch', state}
end
if st == 'c' then
  if not rec then
    return {'corrupt', 'completed record without rec'}
  end
  return {'completed', rec}
end
if st == 'a' then
  if not rec or not done then
    return {'corrupt', 'abandoned record without rec or done'}
  end
  return {'abandoned', rec, done, exp}
end
local lease_ms = tonumber(lease)
if not lease_ms then
  return {'corrupt', 'pending record without a lease'}
end
if lease_ms > now then
  return {'in_flight', lease}
end
if ARGV[3] == 'retry' then
  return claim(1, true)
end
-- Fail closed: the holder died mid-call, so whether the upstream executed is
-- unknown. The claim (rec) is kept as it is; 'a' marks it settled, with the
-- completion instant and the new expiry beside it.
if not rec then
  return {'corrupt', 'pending record without rec'}
end
redis.call('HDEL', key, 'tok', 'lease')
redis.call('HSET', key, 'st', 'a', 'done', ARGV[1], 'exp', ARGV[9])
redis.call('PEXPIRE', key, ARGV[10])
return {'settled', rec, ARGV[1], ARGV[9]}
